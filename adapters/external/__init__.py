"""External environments (seed 002): simulators, games and robots that Shoal does not step itself talk to a
Shoal server over the protocol of docs/external-protocol.md.

- :mod:`adapters.external.messages`: the protocol's messages and arrays (numpy + msgpack).
- :mod:`adapters.external.client`: the Python client a simulator embeds (numpy + websockets).
"""
