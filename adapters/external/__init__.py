"""External environments (seed 002): simulators, games and robots that Shoal does not step itself talk to a
Shoal server over the protocol of docs/external-protocol.md.

- :mod:`adapters.external.messages`: the protocol's messages and arrays (numpy + msgpack).
- :mod:`adapters.external.client`: the Python client a simulator embeds (numpy + websockets).
- :mod:`adapters.external.conformance`: the conformance kit (``shoal conformance``, ``python -m
  adapters.external.conformance``): launches a simulator against a checking server and reports every deviation.
  Its parts: ``conformance_launch`` (the launches and the server), ``conformance_session`` (one checked
  connection), ``conformance_checks`` (each message's checks, by the server's codec), ``conformance_actions``
  (random legal actions) and ``conformance_report`` (the report).
"""
