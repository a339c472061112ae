"""Settings from GATEWAY_* variables: defaults, parsing, and clear errors for bad values."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, Settings, load_settings


def test_no_variables_give_the_documented_defaults() -> None:
    settings = load_settings({})
    assert settings == Settings()
    assert (settings.host, settings.port, settings.redis_url) == ("127.0.0.1", 8000, "")
    assert settings.allowed_origins == ("*",)
    assert (settings.dev, settings.auto_create) == (False, True)
    assert settings.replay_limit == 1000 and settings.history_maxlen == 10_000
    assert settings.stream_types == ("delta", "reasoning_delta")


def test_each_kind_of_value_is_parsed() -> None:
    settings = load_settings({
        "GATEWAY_REDIS_URL": "redis://cache:6379/2",
        "GATEWAY_PORT": "9001",
        "GATEWAY_TURN_TIMEOUT": "2.5",
        "GATEWAY_DEV": "yes",
        "GATEWAY_AUTO_CREATE": "0",
        "GATEWAY_ALLOWED_ORIGINS": " https://a.example , https://b.example,,",
        "GATEWAY_STREAM_TYPES": "delta,tool.output_delta",
        "GATEWAY_WAIT_REPLICAS": "0",
    })
    assert settings.redis_url == "redis://cache:6379/2"
    assert settings.port == 9001 and settings.turn_timeout == 2.5
    assert settings.dev is True and settings.auto_create is False
    assert settings.allowed_origins == ("https://a.example", "https://b.example")
    assert settings.stream_types == ("delta", "tool.output_delta")


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False),
])
def test_boolean_spellings(raw: str, value: bool) -> None:
    assert load_settings({"GATEWAY_DEV": raw}).dev is value


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_REPLAY_LIMIT", "17")
    monkeypatch.setenv("REPLAY_LIMIT", "99")  # no prefix: not ours
    assert load_settings().replay_limit == 17


def test_overrides_win_over_the_environment_and_none_is_no_override() -> None:
    env = {"GATEWAY_PORT": "9001", "GATEWAY_DATA_DIR": "/from/env"}
    settings = load_settings(env, port=9002, data_dir=None)
    assert settings.port == 9002 and settings.data_dir == "/from/env"


@pytest.mark.parametrize(("name", "raw"), [
    ("GATEWAY_PORT", "eighty"),
    ("GATEWAY_PORT", ""),
    ("GATEWAY_PORT", "80.5"),
    ("GATEWAY_REPLAY_LIMIT", "1e3"),
    ("GATEWAY_TURN_TIMEOUT", "soon"),
    ("GATEWAY_RATE_LIMIT", "50/s"),
    ("GATEWAY_DEV", "maybe"),
    ("GATEWAY_AUTO_CREATE", "2"),
])
def test_a_value_of_the_wrong_kind_names_the_variable_and_the_value(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({name: raw})
    assert f"{name}={raw!r}" in str(caught.value)


POSITIVE = ["GATEWAY_REPLAY_LIMIT", "GATEWAY_BUFFER_MAX_FRAMES", "GATEWAY_BUFFER_MAX_BYTES",
            "GATEWAY_QUEUE_MAX_BYTES", "GATEWAY_MAX_FRAME_BYTES", "GATEWAY_MAX_SUBSCRIPTIONS",
            "GATEWAY_MAX_CONNECTIONS_PER_USER", "GATEWAY_INBOX_PARTITIONS",
            "GATEWAY_STREAM_MAX_BYTES", "GATEWAY_REDIS_TIMEOUT", "GATEWAY_WAIT_TIMEOUT_MS",
            "GATEWAY_LIST_SCAN"]


@pytest.mark.parametrize("name", POSITIVE)
@pytest.mark.parametrize("raw", ["0", "-1"])
def test_a_size_count_or_timeout_must_be_positive(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} must be positive$"):
        load_settings({name: raw})
    attribute = name.removeprefix("GATEWAY_").lower()
    assert getattr(load_settings({name: "1"}), attribute) == 1


def test_a_timeout_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^GATEWAY_REDIS_TIMEOUT must be positive$"):
        load_settings({"GATEWAY_REDIS_TIMEOUT": "nan"})


@pytest.mark.parametrize("raw", ["-1", "nan", "inf"])
def test_a_conversation_ttl_is_off_or_seconds(raw: str) -> None:
    assert load_settings({}).conversation_ttl == 0
    assert load_settings({"GATEWAY_CONVERSATION_TTL": "86400"}).conversation_ttl == 86400
    with pytest.raises(ConfigError, match=r"^GATEWAY_CONVERSATION_TTL must be 0 \(off\)"):
        load_settings({"GATEWAY_CONVERSATION_TTL": raw})


def test_wait_replicas_may_be_zero_but_not_negative() -> None:
    assert load_settings({"GATEWAY_WAIT_REPLICAS": "0"}).wait_replicas == 0
    assert load_settings({"GATEWAY_WAIT_REPLICAS": "2"}).wait_replicas == 2
    with pytest.raises(ConfigError, match=r"^GATEWAY_WAIT_REPLICAS must not be negative$"):
        load_settings({"GATEWAY_WAIT_REPLICAS": "-1"})


@pytest.mark.parametrize("kind", ["Delta", "message", "delta2", "x_delta_", "_delta",
                                  "a" * 59 + "_delta"])
def test_a_stream_type_must_be_delta_or_x_delta(kind: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings({"GATEWAY_STREAM_TYPES": f"delta,{kind}"})
    assert "GATEWAY_STREAM_TYPES" in str(caught.value) and repr(kind) in str(caught.value)


def test_the_longest_stream_type_is_accepted() -> None:
    longest = "a" * 58 + "_delta"
    assert load_settings({"GATEWAY_STREAM_TYPES": longest}).stream_types == (longest,)


def test_an_override_of_the_wrong_type_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"\$\.port"):
        load_settings({}, port="eighty")


def test_a_webhook_needs_a_secret_receivers_can_check() -> None:
    with pytest.raises(ConfigError, match="GATEWAY_WEBHOOK_SECRET"):
        load_settings({"GATEWAY_WEBHOOK_URL": "https://push.example/hook"})
    with pytest.raises(ConfigError, match="GATEWAY_WEBHOOK_SECRET"):
        load_settings({"GATEWAY_WEBHOOK_URL": "https://push.example/hook",
                       "GATEWAY_WEBHOOK_SECRET": "short"})
    settings = load_settings({"GATEWAY_WEBHOOK_URL": "https://push.example/hook",
                              "GATEWAY_WEBHOOK_SECRET": "s" * 16})
    assert settings.webhook_timeout == 10.0
