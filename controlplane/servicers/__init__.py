"""The gRPC and HTTP servicers: thin translations between Envoy's and the admin API's messages and the control plane's
ports (``controlplane/ports.py``). ``authz``: ext_authz's Check; ``accesslog``: Envoy's access log; ``admin`` and
``admin_views``: the admin API (``adminauth``: its token); ``httpendpoint``: health, metrics and the retry redirector."""
