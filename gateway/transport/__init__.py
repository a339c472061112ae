"""The WebSocket transport: prebuilt frames written straight to sockets.

``frames``    complete WebSocket frames (header + payload), built once per process
``protocol``  uvicorn's websockets-sansio protocol, extended with the fast path and a log
              that never holds a token
``outbound``  what a session writes through: the fast path, or plain ASGI ``send``
``cork``      frames handed out together leave in one write per socket
"""
