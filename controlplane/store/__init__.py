"""What must survive a control-plane process or be shared between replicas: the ``Store`` port (``base.py``) and its
backends (``memory.py``, ``valkey.py``), and the project-started Valkey server (``valkeyserver.py``)."""
