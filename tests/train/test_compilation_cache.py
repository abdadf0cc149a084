"""Where a run's compiled programs are cached: the choice by hand for each setting."""

from __future__ import annotations

import types

from jaxrlhf.train.compilation_cache import CacheChoice, choose

HOME = "/home/u"


def test_the_default_is_the_users_cache_directory():
    assert choose({}, HOME) == CacheChoice("/home/u/.cache/jaxrlhf/xla", "default")
    assert choose({"XDG_CACHE_HOME": "/c"}, HOME) == CacheChoice("/c/jaxrlhf/xla", "default")


def test_jaxs_own_directory_wins_then_ours_then_off():
    both = {"JAX_COMPILATION_CACHE_DIR": "/j", "JAXRLHF_COMPILATION_CACHE": "/r"}
    assert choose(both, HOME) == CacheChoice("/j", "JAX_COMPILATION_CACHE_DIR")
    assert choose({"JAXRLHF_COMPILATION_CACHE": "~/x"}, HOME).directory == "/home/u/x"
    assert choose({"JAXRLHF_COMPILATION_CACHE": "/r"}, HOME) == CacheChoice(
        "/r", "JAXRLHF_COMPILATION_CACHE"
    )
    for off in ("off", "OFF", " off "):
        assert choose({"JAXRLHF_COMPILATION_CACHE": off}, HOME).directory is None
    # JAX's own variable set to nothing is not a choice.
    assert choose({"JAX_COMPILATION_CACHE_DIR": ""}, HOME).source == "default"


def test_enable_sets_jaxs_cache_settings_unless_the_user_did(monkeypatch):
    """The directory, the 1 s threshold and the size limit go to JAX's config; a threshold
    or limit the user set through JAX's variables stays; JAX's own directory, or off, sets
    nothing."""
    from jaxrlhf.train import compilation_cache as cc

    updates: list[tuple[str, object]] = []
    fake_jax = types.SimpleNamespace(
        config=types.SimpleNamespace(update=lambda name, value: updates.append((name, value)))
    )
    monkeypatch.setattr(cc, "jax", fake_jax)  # this module's view of jax only
    assert cc.enable({"JAXRLHF_COMPILATION_CACHE": "/r"}).directory == "/r"
    assert updates == [
        ("jax_compilation_cache_dir", "/r"),
        ("jax_persistent_cache_min_compile_time_secs", 1.0),
        ("jax_compilation_cache_max_size", 20 << 30),
    ]
    updates.clear()
    user = {"JAXRLHF_COMPILATION_CACHE": "/r", "JAX_COMPILATION_CACHE_MAX_SIZE": "5"}
    user["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    cc.enable(user)
    assert updates == [("jax_compilation_cache_dir", "/r")]
    updates.clear()
    cc.enable({"JAX_COMPILATION_CACHE_DIR": "/j"})
    cc.enable({"JAXRLHF_COMPILATION_CACHE": "off"})
    assert updates == []
