"""The listener's Lua filters (Envoy's ``lua`` HTTP filter), and the dynamic metadata they read and write: the body's model
as a header for the fail-open routes, client ``x-sluice-*`` headers stripped, and the response reader whose metadata
the access log reads (``AUTHZ_NAMESPACE``, ``USAGE_NAMESPACE``, ``FIRST_TOKEN_KEY``)."""

from __future__ import annotations

from controlplane.names import MODEL_HEADER

METADATA_NAMESPACE = "sluice"
AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
USAGE_NAMESPACE = "sluice.usage"
"""Dynamic metadata the Lua response filter writes: on an admitted stream ``first_token_us`` (when its first token passed
Envoy, microseconds since the epoch); the engine's ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` when a
usage object passes (a non-streaming body's, a stream's with ``stream_options.include_usage``); ``deltas``, the content
deltas a response carried. The access log
reads them."""
FIRST_TOKEN_KEY = "first_token_us"
USAGE_PENDING_MAX_BYTES = 65536
"""The Lua usage filter keeps the text after the last complete SSE event (a whole non-streaming body) up to this much;
past it only the last 4 KiB stay (a body's ``usage`` object comes last)."""


def strip_headers_lua(kept: tuple[str, ...]) -> str:
    """Lua that removes every ``x-sluice-*`` request header except the client inputs in ``kept``.

    Envoy's header-mutation filters only remove exact names; a client could invent any ``x-sluice-`` header, so the prefix
    match needs code. This runs before ext_authz: nothing a client sends under that prefix reaches a decision or an engine
    unless it is a documented input.
    """
    keep = ", ".join(f'["{h}"] = true' for h in kept)
    return f"""
local keep = {{{keep}}}
function envoy_on_request(handle)
  local doomed = {{}}
  for name, _ in pairs(handle:headers()) do
    if string.sub(name, 1, 9) == "x-sluice-" and not keep[name] then
      doomed[#doomed + 1] = name
    end
  end
  for _, name in ipairs(doomed) do
    handle:headers():remove(name)
  end
end
"""


MODEL_HEADER_LUA = f"""
function envoy_on_request(handle)
  local found = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if found ~= nil and found["model"] ~= nil then
    handle:headers():replace("{MODEL_HEADER}", found["model"])
  end
end
"""


# The response side of an admitted request (its ext_authz metadata holds a ticket; every other response returns at once
# and is never read). It reads body chunks as they pass (bodyChunks: Envoy does not buffer the stream for it). An event is
# the text between blank lines; a non-streaming body is one event, read when the body ends.
# - A stream (content-type text/event-stream): the moment the first event carrying a token passes (content, text,
#   reasoning or a tool call), in microseconds since the epoch, is kept as ``first_token_us``. A non-streaming
#   response's first token is left to the access log (its whole body: the last upstream byte's time).
# - The engine's usage object when one passes (a non-streaming body's; a stream's last SSE chunk with
#   stream_options.include_usage): the access log learns prompt tokens from it, reports the answer's length against
#   the estimate and settles a tenant's request with it.
# - The content deltas streamed so far (written after each chunk that added some, so a tenant's client that leaves
#   mid-stream is charged what it was sent, and a stream without a usage object still has a length).
USAGE_LUA = f"""
local NS = "{USAGE_NAMESPACE}"
local MAX_PENDING = {USAGE_PENDING_MAX_BYTES}
local FIELDS = {{"prompt_tokens", "completion_tokens", "total_tokens"}}
local TOKEN_PATTERNS = {{'"content"%s*:%s*"[^"]', '"text"%s*:%s*"[^"]', '"reasoning_content"%s*:%s*"[^"]',
                        '"reasoning"%s*:%s*"[^"]', '"tool_calls"%s*:%s*%[%s*{{'}}

local function has_token(text)
  for _, pattern in ipairs(TOKEN_PATTERNS) do
    if string.find(text, pattern) then
      return true
    end
  end
  return false
end

function envoy_on_response(handle)
  local authz = handle:streamInfo():dynamicMetadata():get("{AUTHZ_NAMESPACE}")
  if authz == nil or authz["ticket"] == nil then
    return
  end
  local content_type = handle:headers():get("content-type")
  local streamed = content_type ~= nil and string.find(content_type, "text/event-stream", 1, true) ~= nil
  local waiting_first = streamed
  -- Envoy's objects are valid only until the script yields (each chunk): fetch the metadata object afresh every time.
  local function put(key, value)
    handle:streamInfo():dynamicMetadata():set(NS, key, value)
  end
  local deltas = 0
  local pending = ""
  local function event(text)
    if waiting_first and has_token(text) then
      put("{FIRST_TOKEN_KEY}", tonumber(handle:timestampString(EnvoyTimestampResolution.MICROSECOND)))
      waiting_first = false
    end
    if string.find(text, '"content"%s*:%s*"[^"]') or string.find(text, '"text"%s*:%s*"[^"]') then
      deltas = deltas + 1
    end
    local at = string.find(text, '"usage"%s*:%s*{{')
    if at ~= nil then
      local part = string.sub(text, at, at + 1024)
      for _, name in ipairs(FIELDS) do
        local n = string.match(part, '"' .. name .. '"%s*:%s*(%d+)')
        if n ~= nil then
          put(name, tonumber(n))
        end
      end
    end
  end
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      local before = deltas
      pending = pending .. (string.gsub(chunk:getBytes(0, size), "\\r", ""))
      local start = 1
      while true do
        local stop = string.find(pending, "\\n\\n", start, true)
        if stop == nil then
          break
        end
        event(string.sub(pending, start, stop - 1))
        start = stop + 2
      end
      pending = string.sub(pending, start)
      if #pending > MAX_PENDING then
        pending = string.sub(pending, -4096)
      end
      if deltas ~= before then
        put("deltas", deltas)
      end
    end
  end
  if #pending > 0 then
    local before = deltas
    event(pending)
    if deltas ~= before then
      put("deltas", deltas)
    end
  end
end
"""
