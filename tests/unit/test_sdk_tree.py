"""The client's conversation tree (protocol.md, "The conversation tree"): the nodes kept from
the events, the head moved only by newer news, the active path, siblings and forks, pages
of history with their ``forks``, and a reset."""

from __future__ import annotations

from typing import Any

from gateway.sdk.tree import ConversationTree, HeadMove, Siblings


class Log:
    """Frames of one conversation, as the gateway writes them: contiguous seqs."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    def add(self, kind: str, data: dict[str, Any], node: str | None = None) -> dict[str, Any]:
        frame: dict[str, Any] = {"type": kind, "chat_id": "c", "seq": len(self.frames) + 1,
                                 "ts": 1, "data": data}
        if node is not None:
            frame["node"] = node
        self.frames.append(frame)
        return frame

    def head(self, head: str | None, prev: str | None, cause: str) -> dict[str, Any]:
        return self.add("head", {"head_id": head, "prev_head_id": prev, "cause": cause,
                                 "by": "u1"})

    def message(self, msg: str, parent: str | None, turn: str, prev: str | None,
                edit_of: str | None = None) -> list[dict[str, Any]]:
        data: dict[str, Any] = {"text": msg, "client_msg_id": "x", "user_id": "u1",
                                "msg_id": msg, "parent_id": parent}
        if edit_of is not None:
            data["edit_of"] = edit_of
        return [self.add("user_message", data, msg),
                self.add("turn_start", {"turn_id": turn, "started_at": 1, "parent_id": msg},
                         turn),
                self.head(turn, prev, "edit" if edit_of else "message")]

    def answer(self, turn: str, text: str) -> list[dict[str, Any]]:
        return [self.add("message", {"text": text}, turn),
                self.add("turn_end", {"turn_id": turn, "reason": "complete"}, turn)]

    def retry(self, msg: str, old: str, new: str) -> list[dict[str, Any]]:
        return [self.add("turn_start", {"turn_id": new, "started_at": 1, "parent_id": msg,
                                        "retry_of": old}, new),
                self.head(new, old, "retry")]


def fed(log: Log, tree: ConversationTree | None = None) -> ConversationTree:
    tree = tree if tree is not None else ConversationTree()
    for frame in log.frames:
        tree.apply(frame)
    return tree


def a_forked_log() -> Log:
    """m1 → t1 (retried as t2) → m2 → t3; then m2 edited as m3 → t4 (the head)."""
    log = Log()
    log.message("m1", None, "t1", None)
    log.answer("t1", "first answer")
    log.retry("m1", "t1", "t2")
    log.answer("t2", "second answer")
    log.message("m2", "t2", "t3", "t2")
    log.answer("t3", "an answer to m2")
    log.message("m3", "t2", "t4", "t3", edit_of="m2")
    return log


def test_the_events_build_the_tree_and_the_head_follows_them() -> None:
    tree = fed(a_forked_log())
    assert tree.head == "t4" and tree.head_known
    assert tree.path() == ["m1", "t2", "m3", "t4"]
    assert tree.roots == ["m1"]
    assert tree.nodes["m1"].children == ["t1", "t2"]
    assert tree.nodes["t2"].children == ["m2", "m3"]
    assert (tree.nodes["t2"].kind, tree.nodes["t2"].parent_id) == ("turn", "m1")
    assert tree.siblings("t2") == Siblings(["t1", "t2"], 1)
    assert tree.siblings("m3") == Siblings(["m2", "m3"], 1)
    assert tree.siblings("m1") == Siblings(["m1"], 0)
    assert tree.forks() == {"t2": Siblings(["t1", "t2"], 1), "m3": Siblings(["m2", "m3"], 1)}
    assert tree.missing() == []


def test_a_head_event_reports_its_move() -> None:
    log = a_forked_log()
    tree = fed(log)
    move = tree.apply(log.head("t2", "t4", "undo"))
    assert move == HeadMove("t2", "t4", log.frames[-1]["seq"], "undo", "u1")
    assert tree.path() == ["m1", "t2"]
    # Applying the same frame again changes nothing.
    assert tree.apply(log.frames[-1]) is None
    assert tree.apply(log.head(None, "t2", "undo")) == HeadMove(None, "t2", len(log.frames),
                                                                "undo", "u1")
    assert tree.path() == [] and tree.head_known


def test_only_the_active_paths_events_are_visible() -> None:
    log = a_forked_log()
    tree = fed(log)
    by_text = {f["data"]["text"]: f for f in log.frames if "text" in f["data"]}
    assert tree.visible(by_text["second answer"])
    assert not tree.visible(by_text["first answer"])  # t1: retried
    assert not tree.visible(by_text["an answer to m2"])  # under m2: edited
    assert tree.visible(log.frames[-1])  # a head event has no node
    assert tree.visible({"type": "delta", "seq": None, "data": {"text": "x"}})
    assert tree.on_path("m3") and not tree.on_path("m2") and not tree.on_path(None)


def test_older_news_never_moves_the_head_back() -> None:
    """A resume with since: the snapshot tells the head now (as of its seq), then the replay
    brings every older move, which must not make the head flicker back."""
    log = a_forked_log()
    tree = ConversationTree()
    moved = tree.set_head("t4", len(log.frames))
    assert moved == HeadMove("t4", None, len(log.frames))
    moves = [tree.apply(frame) for frame in log.frames]
    assert [m for m in moves if m is not None] == []
    assert tree.head == "t4" and tree.path() == ["m1", "t2", "m3", "t4"]
    # An ack's head is as of its seq: older than the head event known, it is ignored.
    assert tree.set_head("t1", 2) is None and tree.head == "t4"
    # A head told without a seq is taken only when none is known.
    assert tree.set_head("t1", None) is None and tree.head == "t4"
    fresh = ConversationTree()
    assert fresh.set_head("t1", None) == HeadMove("t1", None, None)
    assert fresh.head_known and fresh.set_head("t2", 0) is not None


def test_a_client_that_joined_live_knows_the_path_from_where_it_joined() -> None:
    log = a_forked_log()
    tree = ConversationTree()
    tree.set_head("t4", len(log.frames))
    assert tree.path() == ["t4"] and tree.missing() == ["t4"]
    frames = log.message("m4", "t4", "t5", "t4")
    for frame in frames:
        tree.apply(frame)
    # t4 is known only as m4's parent: a placeholder, and the path stops there.
    assert tree.path() == ["t4", "m4", "t5"]
    assert tree.missing() == ["t4"]
    assert tree.nodes["t4"].kind == "turn" and not tree.nodes["t4"].seen
    # The events before it (say, a history page) fill it in.
    fed(log, tree)
    assert tree.path() == ["m1", "t2", "m3", "t4", "m4", "t5"] and tree.missing() == []
    assert tree.nodes["t4"].children == ["m4"]


def test_a_page_of_the_active_path_with_its_forks() -> None:
    log = a_forked_log()
    on_path = {"m1", "t2", "m3", "t4"}
    page = {"chat_id": "c", "epoch": "e", "last_seq": len(log.frames), "next_after": None,
            "head": "t4",
            "forks": {"t2": {"siblings": ["t1", "t2"], "index": 1},
                      "m3": {"siblings": ["m2", "m3"], "index": 1}},
            "events": [f for f in log.frames if f.get("node") is None or f["node"] in on_path]}
    tree = ConversationTree()
    move = tree.load_page(page)
    assert move is not None and (move.head, move.previous) == ("t4", None)
    assert tree.path() == ["m1", "t2", "m3", "t4"]
    assert tree.siblings("t2") == Siblings(["t1", "t2"], 1)
    assert tree.siblings("m3") == Siblings(["m2", "m3"], 1)
    # The siblings off the path are placeholders: known by id, their events not held.
    assert not tree.nodes["t1"].seen and tree.nodes["t1"].kind == "turn"
    assert tree.nodes["m2"].parent_id == "t2"
    # A switch to one of them: the head goes to a node the client never saw.
    tree.apply(log.head("t3", "t4", "switch"))
    assert tree.path() == ["t3"] and tree.missing() == ["t3"]
    # A later sibling arrives live: after the listed ones.
    for frame in log.retry("m1", "t2", "t9"):
        tree.apply(frame)
    assert tree.siblings("t9") == Siblings(["t1", "t2", "t9"], 2)
    # Loading the page again changes nothing, and the older head in it is ignored.
    assert tree.load_page(page) is None
    assert tree.head == "t9"


def test_a_page_applied_after_live_events_keeps_creation_order() -> None:
    log = a_forked_log()
    tree = ConversationTree()
    later = log.retry("m1", "t2", "t5")
    for frame in later:
        tree.apply(frame)
    fed(log, tree)  # the older events, after the newer ones
    assert tree.nodes["m1"].children == ["t1", "t2", "t5"]
    assert tree.head == "t5"


def test_reset_forgets_everything() -> None:
    tree = fed(a_forked_log())
    tree.reset()
    assert tree.nodes == {} and tree.roots == [] and tree.path() == []
    assert tree.head is None and not tree.head_known
    # After a reset, the new history's head is taken whatever its seq.
    assert tree.set_head("t1", 3) == HeadMove("t1", None, 3)


def test_ignored_frames() -> None:
    tree = ConversationTree()
    assert tree.apply({"type": "user_message", "seq": None, "data": {"msg_id": "m"}}) is None
    assert tree.apply({"type": "turn_start", "seq": 1, "data": "nope"}) is None
    assert tree.apply({"type": "user_message", "seq": 1, "data": {"msg_id": 5}}) is None
    assert tree.apply({"type": "head", "seq": 2, "data": {"head_id": 7}}) is None
    assert tree.nodes == {} and not tree.head_known
