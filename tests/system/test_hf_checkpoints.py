"""Real Hugging Face checkpoints end to end: transformers trains small Llama and Qwen3-MoE models and saves
sharded checkpoints; the CLI publishes each step (bf16), ``pull --to DIR`` writes a checkpoint that
transformers loads, bitwise equal to the bf16 cast of the trained model; a daemon with ``export.dir``
writes the same."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch

from patchswarm.daemon.checkpoint import read_checkpoint
from patchswarm.protocol.keys import SigningKey
from tests.support.boards import Keys
from tests.support.daemonkit import make_daemon
from tests.support.hf_models import tiny_llama, train_step
from tests.support.swarmkit import RUN, Swarm

transformers = pytest.importorskip("transformers")  # the dev extra

SHARD_BYTES = 200_000  # the fp32 models are 430-560 KB: 3 shards or more


def qwen3_moe() -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=128,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "patchswarm.daemon.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),  # keeps PYTHONPATH: this tree's code
    )


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


def assert_loads_bitwise(path: Path, expected: dict[str, torch.Tensor]) -> torch.nn.Module:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)  # dtype from the written config.json
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name
    return loaded


def shards(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("build", [tiny_llama, qwen3_moe], ids=["llama-tied", "qwen3-moe"])
def test_checkpoints_publish_and_pull_bitwise_at_every_step(tmp_path: Path, build: object) -> None:
    assert callable(build)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    keys = Keys(SigningKey.generate(), SigningKey.generate())
    keys.trainer.save(tmp_path / "trainer.key")
    keys.root.save(tmp_path / "root.key")
    (tmp_path / "trainer.cert").write_bytes(keys.certificate(RUN))
    common = ["--board", "board", "--key", "trainer.key", "--run-id", RUN, "--served-format", "bf16"]
    before: dict[str, torch.Tensor] | None = None
    for step in range(1, 4):
        train_step(model, opt, step)
        state = bf16_state(model)
        if before is not None:  # lr 1e-3: the weights really move between steps
            assert any(not torch.equal(state[k], before[k]) for k in state)
        before = state
        ck = tmp_path / f"step{step}"
        model.save_pretrained(ck, max_shard_size=SHARD_BYTES)
        assert len(shards(ck)) >= 2 and (ck / "model.safetensors.index.json").is_file()

        cert = ["--cert", "trainer.cert"] if step == 1 else []
        r = cli("publish", ck.name, *common, *cert, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"published version {step}" in r.stdout and "(served bf16)" in r.stdout, r.stdout

        # Step 1: a new name, a directory because the run ships checkpoint files; later: the directory,
        # patched from what it holds.
        to = ["--to", "pulled"] if step == 1 else ["--to", "pulled/", "--have", "pulled"]
        r = cli("pull", "--from", "board", "--run", RUN, "--trust", "root.key.pub", *to, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert f"version {step}" in r.stdout and "checkpoint directory" in r.stdout, r.stdout
        pulled = tmp_path / "pulled"
        cfg = json.loads((pulled / "config.json").read_text())
        assert cfg["dtype"] == "bfloat16"
        assert json.loads((ck / "config.json").read_text())["dtype"] == "float32"  # the source's, changed
        if cfg.get("tie_word_embeddings"):  # left out as transformers saves it; tied again on load
            assert shards(pulled) == ["model.safetensors"]  # under 5 GB: one file, as transformers writes it
            with safetensors.safe_open(str(pulled / "model.safetensors"), "pt") as f:
                assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())
        loaded = assert_loads_bitwise(pulled, state)
        if cfg.get("tie_word_embeddings"):
            assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


async def wait_export(export: Path, version: int) -> None:
    for _ in range(1200):  # the export follows the activation
        if (export / "current").is_symlink() and os.readlink(export / "current") == f"v{version}":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{export}/current never pointed at v{version}")


@pytest.mark.slow
@pytest.mark.asyncio
async def test_daemon_exports_each_version_as_a_checkpoint_directory(tmp_path: Path) -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sw = Swarm(tmp_path)
    assert sw.pub is not None
    export = tmp_path / "export"

    def publish(step: int) -> None:
        assert sw.pub is not None
        train_step(model, opt, step)
        model.save_pretrained(tmp_path / f"step{step}", max_shard_size=SHARD_BYTES)
        ck = read_checkpoint(tmp_path / f"step{step}")
        sw.pub.publish(ck.tensors, metadata=ck.metadata())

    publish(1)
    await sw.start_seed()
    d = make_daemon(sw, "d1", tmp_path, extra=f'[export]\ndir = "{export}"\n')
    d.start()
    try:
        for step in range(1, 5):
            if step > 1:
                if step == 3:  # a file where v3 goes: the export fails, serving does not
                    (export / "v3").write_text("in the way")
                publish(step)
            st = await d.wait_version(step)
            if step == 3:
                for _ in range(600):
                    st = await d.status()
                    if st is not None and (st["reason"] or "").startswith("export.dir: version 3"):
                        break
                    await asyncio.sleep(0.05)
                assert st is not None and "not a directory" in st["reason"] and st["version"] == 3, st
                assert os.readlink(export / "current") == "v2"
                continue
            await wait_export(export, step)
            st = await d.status()
            assert st is not None and "export" not in (st["reason"] or "")  # a success clears the reason
            assert_loads_bitwise(export / "current", bf16_state(model))
        assert sorted(p.name for p in export.iterdir()) == ["current", "v3", "v4"]  # the last 2 kept
        assert await d.stop() == 0
        assert "export failed" in d.log.read_text()
    finally:
        d.cleanup()
        await sw.close()
