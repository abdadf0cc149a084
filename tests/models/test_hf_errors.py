"""Bad checkpoints give one-line errors that say what is wrong and where."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxrlhf.models.hf_checkpoint import load_hf
from jaxrlhf.models.safetensors_io import CheckpointError, SafetensorsReader
from tests.models.hf_fixtures import make_hf_model

pytest.importorskip("torch")


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.fixture
def llama_dir(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    return tmp_path


def test_missing_safetensors_file(llama_dir):
    os.remove(llama_dir / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    msg = _one_line(e)
    assert "no model.safetensors or model.safetensors.index.json" in msg and str(llama_dir) in msg


def test_shard_listed_in_index_but_missing(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(CheckpointError) as e:
        load_hf(str(tmp_path))
    assert "safetensors file not found" in _one_line(e) and victim in str(e.value)


def test_pickle_only_checkpoint_is_refused(llama_dir):
    os.remove(llama_dir / "model.safetensors")
    (llama_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    assert "never pickle" in _one_line(e) and "pytorch_model.bin" in str(e.value)


def test_incomplete_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(CheckpointError) as e:
        load_hf(str(tmp_path))
    assert "missing required llama attributes ['hidden_size'" in _one_line(e)


def test_tensor_with_wrong_shape(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = np.zeros((63, 32), np.float32)
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    msg = _one_line(e)
    assert key in msg and "[63, 32]" in msg and "[64, 32]" in msg and "model.safetensors" in msg


def test_missing_and_extra_tensors(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.0.self_attn.k_proj.weight'"):
        load_hf(str(llama_dir))
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 32), np.float32)
    tensors["model.layers.0.self_attn.extra_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="extra_proj"):
        load_hf(str(llama_dir))


def test_unsupported_architecture(llama_dir):
    cfg = json.load(open(llama_dir / "config.json"))
    cfg["model_type"] = "deepseek_v3"
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    msg = _one_line(e)
    assert "model_type 'deepseek_v3' is not supported" in msg and "config.json" in msg


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"mystery_option": 3}, "unsupported llama config attributes ['mystery_option']"),
        ({"hidden_act": "relu"}, "unsupported llama values {'hidden_act': 'relu'}"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'yarn' is not supported",
        ),
    ],
)
def test_unsupported_config_fields_are_named(llama_dir, change, expected):
    cfg = json.load(open(llama_dir / "config.json"))
    cfg.update(change)
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    assert expected in _one_line(e)


def test_truncated_safetensors_file(llama_dir):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy cut off half way
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    msg = _one_line(e)
    assert msg.startswith(f"{path} is truncated: tensor ")
    assert f"but the file has {len(data) // 2} bytes" in msg


def test_safetensors_file_of_random_bytes(llama_dir):
    path = llama_dir / "model.safetensors"
    size = path.stat().st_size
    path.write_bytes(np.random.default_rng(0).bytes(size))
    with pytest.raises(CheckpointError) as e:
        load_hf(str(llama_dir))
    msg = _one_line(e)
    assert msg.startswith(f"{path} is not a valid safetensors file or is truncated")
    assert f"the file has {size})" in msg


@pytest.mark.parametrize(
    "header, expected",
    [
        (b"[1, 2]", "header is not an object"),
        (b'{"w": {"dtype": "F32", "shape": [2]}}', "malformed header entry for tensor w"),
        (
            b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}',
            "tensor w of shape [2] (F32) has data offsets [0, 4], which do not span its 8 bytes",
        ),
        (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8', "header is not JSON"),
    ],
)
def test_damaged_safetensors_header(tmp_path, header, expected):
    import struct

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError) as e:
        SafetensorsReader(str(tmp_path))
    msg = _one_line(e)
    assert msg.startswith(str(path)) and expected in msg


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"model_type": "qwen3_moe", "mlp_only_layers": [0]},
            "qwen3_moe with dense layers (mlp_only_layers=[0]) is not supported",
        ),
        ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, "{'decoder_sparse_step': 2}"),
        (
            {"model_type": "gemma3_text", "use_bidirectional_attention": True},
            "use_bidirectional_attention=true (an encoder) is not supported",
        ),
        (
            {
                "model_type": "phi3",
                "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
            },
            "rope type 'longrope' is not supported",
        ),
        ({"model_type": "gemma3"}, "model_type 'gemma3' is not supported"),  # multimodal
        (
            {"model_type": "gemma2", "layer_types": ["full_attention"]},
            "layer_types must list 2 of",
        ),
        ({"model_type": "llama", "sliding_window": 4}, "llama has no sliding-window attention"),
        (
            {"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
            "num_experts_per_tok=3 must be in [1, num_experts=2]",
        ),
    ],
)
def test_new_family_configs_we_cannot_run_are_refused(config, expected):
    """One-line errors, naming the file, for the options of the new families that jaxrlhf
    does not implement (instead of different logits)."""
    from jaxrlhf.models.hf_config import UnsupportedConfigError, from_hf_config

    base = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(UnsupportedConfigError) as e:
        from_hf_config(base | config, source="ckpt/config.json")
    message = _one_line(e)
    assert expected in message and message.startswith("ckpt/config.json: ")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(layer_types=("full_attention",)), "layer_types has 1 entries for num_layers=2"),
        (
            dict(layer_types=("sliding_attention", "full_attention")),
            "layer_types has sliding layers but no sliding_window",
        ),
        (dict(num_experts=2, num_experts_per_tok=3), "num_experts_per_tok=3 must be in"),
        (dict(partial_rotary_factor=0.2), "rotates 1 of 8 head dims"),  # int(8 * 0.2)
        (dict(attn_logit_softcap=0.0), "attn_logit_softcap must be > 0"),
    ],
)
def test_model_config_checks(overrides, expected):
    from jaxrlhf.models.config import ModelConfig

    with pytest.raises(ValueError) as e:
        ModelConfig.tiny("llama", **overrides)
    assert expected in _one_line(e)
