"""Where everything of a conversation and of a user lives in Redis.

Every key of a conversation carries the hash tag ``{chat_id}``, so each script touches one
cluster slot, and its pub/sub channel is a sharded channel in that slot: on a cluster, its
traffic goes only to the shard that owns it. A user's keys share ``{u:<user>}``::

    c:{chat}:meta        hash: owner, title, status, turn_id, started_at, goal, epoch, seq,
                         parent (a sub-conversation: its parent's chat id), role:<user>
                         (a member's role, "member" or "viewer": lua/members.lua), ...
    c:{chat}:stream      the event log (a Redis Stream): entry "<seq>-0", field "f" = frame
    c:{chat}:tree        hash: the conversation tree, node id -> node (lua/tree.lua)
    c:{chat}:starts      sorted set: the seq of every user message still in the log, the
                         turn boundaries where a trim may cut (lua/publish.lua)
    c:{chat}:text:<type> the text of the conversation's open stream of a streamed type
                         (its header is meta field st:<type>; lua/lib.lua reads it)
    c:{chat}:idem:<key>  first result of an idempotent publish or message (TTL)
    c:{chat}:children    sorted set: the conversation's sub-conversations by creation (ms)
    c:{chat}:ev          sharded pub/sub channel of the room
    c:{chat}:presence    sorted set: who is connected now, one member per connection or
                         agent worker, scored by when it lapses (lua/presence.lua; TTL)
    c:{chat}:presence:v  the presence list's version (TTL)
    {u:<user>}:feed      sharded pub/sub channel of a user's conversation feed
    {u:<user>}:convs     sorted set: the user's conversations by last change (owned or shared)
    wst:<sha256>         a WebSocket connection ticket: who it stands for (TTL, used once)
    {x:<n>}:expiry       sorted set n of EXPIRY_BUCKETS: conversations by last list change,
                         where retention finds old ones (gateway/retention.py)

The agent inbox, turn deadlines and the hand-off outbox are :mod:`.agent_inbox`'s.
"""

from __future__ import annotations

import zlib

# Retention's index is split in this many keys, so that it spreads over a cluster's shards.
# Fixed: a conversation must always map to the same one.
EXPIRY_BUCKETS = 16


def meta_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:meta"


def log_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:stream"


def tree_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:tree"


def starts_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:starts"


def text_key(chat_id: str, stream_type: str) -> str:
    return f"c:{{{chat_id}}}:text:{stream_type}"


def idem_key(chat_id: str, key: str) -> str:
    return f"c:{{{chat_id}}}:idem:{key}"


def children_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:children"


def presence_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:presence"


def presence_version_key(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:presence:v"


def room_channel(chat_id: str) -> str:
    return f"c:{{{chat_id}}}:ev"


def feed_channel(user_id: str) -> str:
    return f"{{u:{user_id}}}:feed"


def index_key(user_id: str) -> str:
    return f"{{u:{user_id}}}:convs"


def ticket_key(digest: str) -> str:
    """A WebSocket connection ticket, by the SHA-256 of the ticket (:mod:`gateway.tickets`):
    the key name alone does not let anyone connect."""
    return f"wst:{digest}"


def expiry_bucket(chat_id: str) -> int:
    """The retention bucket of a conversation (a stable hash: every process agrees)."""
    return zlib.crc32(chat_id.encode()) % EXPIRY_BUCKETS


def expiry_key(bucket: int) -> str:
    return f"{{x:{bucket}}}:expiry"
