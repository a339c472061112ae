"""The SDKs: the Python client (:mod:`.client`), the open-stream rules every client
follows (:mod:`.streams`) and the agent worker (:mod:`.agent`). Nothing of the server is
imported here: the client runs in any Python process, the worker beside Redis."""
