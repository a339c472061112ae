"""WebSocket close codes. ``protocol.md`` has the table, and says which ones a client
resumes after."""

UNAUTHORIZED = 4001  # missing or invalid token: terminal
FORBIDDEN = 4003  # origin not allowed: terminal
DISCONNECTED = 4005  # closed by an administrator (POST /v1/admin/disconnect): terminal
PROTOCOL_ABUSE = 4004  # kept sending invalid frames: terminal
SLOW_CONSUMER = 4008  # did not read fast enough: reconnect and resume
TOKEN_EXPIRED = 4011  # reconnect with a fresh token and resume
TOO_MANY = 4029  # rate or connection limit: reconnect after a backoff
TOO_MANY_REASON = "too many connections"  # the reason sent with 4029 past the per-user limit
SERVER_RESTART = 1012  # reconnect and resume
BACKEND_UNAVAILABLE = 1013  # reconnect after a backoff and resume
FRAME_TOO_BIG = 1009  # sent by the WebSocket layer for a frame over the limit

INTERNAL_ERROR = 1011  # a bug in the server, or a keepalive ping not answered in time
