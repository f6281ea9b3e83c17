"""`maxperf run` of a serving artifact (compile --step prefill|decode): the compiled step loaded onto the devices,
run and timed, its latency and throughput beside the prediction, in run.json.

- prefill: each step prefills the batch's B prompts (synthetic tokens) into a fresh cache; measured: the step's
  seconds (the batch's time to first token), prompt tokens/s.
- decode: the cache starts empty as if the prompts filled P positions (its contents do not change the step's work:
  the compiled step attends over every position, masked), then each step decodes one token for every sequence at
  the next position, feeding back the tokens it produced; measured: seconds per output token, output tokens/s.

Both against estimate.json's analytical figure (decode priced at the middle of generation) and the step time read
from the compiled program (which, like the step, attends over the whole cache)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts
from maxperf.aot.loading import Artifact
from maxperf.spec.errors import MaxperfError

SCHEMA = "maxperf.serving-run/1"


def loaded(artifact: Artifact, devices):
    """(the AbstractServe over `devices`, the loaded executable)."""
    import jax

    from maxperf.aot import peak, targets
    from maxperf.models import serving

    p = artifact.plan
    mesh = targets.jax_mesh(p.topology, p.mesh, devices)
    spec = serving.abstract_serve(p.configs.model, p.configs.train, mesh, artifact.manifest["step"])
    in_tree = jax.tree.structure((spec.args, {}))
    with jax.set_mesh(mesh):
        out_tree = jax.tree.structure(jax.eval_shape(spec.jitted(), *spec.args))
    if str(in_tree) != artifact.in_tree or str(out_tree) != artifact.out_tree:
        raise MaxperfError(f"{artifact.directory}: the serving step's structure differs from the one compiled (flax "
                           "changed?); compile again with this installation")
    compiled = peak.load_executable(artifact.payload, in_tree, out_tree, backend=devices[0].client,
                                    execution_devices=devices)
    return spec, compiled


def run(artifact: Artifact, devices, *, steps: int, warmup: int, out_dir: Path, force: bool, used: list,
        say: Callable[[str], None]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maxperf.models import serving

    kind = artifact.manifest["step"]
    p = artifact.plan
    train = p.configs.train
    writer = artifacts.ArtifactWriter(out_dir, "run", force=force, inputs=used)  # --out locked from here
    try:
        spec, step = loaded(artifact, devices)
        say("initializing the weights")
        params_sharding = spec.arg_shardings[0]
        with jax.set_mesh(spec.mesh):
            params = jax.jit(lambda: serving.init_params(p.configs.model, train, train.seed),
                             out_shardings=params_sharding)()
    except BaseException:
        writer.abandon()
        raise
    B, P, S = spec.global_batch, train.max_prefill_predict_length, train.seq_len
    rng = np.random.default_rng(train.seed)
    try:
        times: list[float] = []
        if kind == serving.PREFILL:
            batch = jax.device_put({"tokens": rng.integers(0, p.model.vocab_size, (B, P), dtype=np.int32)},
                                   spec.arg_shardings[1])
            for i in range(warmup + steps):
                t = time.perf_counter()
                jax.block_until_ready(step(params, batch))
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            tokens_per_step = B * P
        else:
            cache_shardings, batch_shardings = spec.arg_shardings[1], spec.arg_shardings[2]
            with jax.set_mesh(spec.mesh):
                cache = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec.args[1]),
                                out_shardings=cache_shardings)()
            tokens = rng.integers(0, p.model.vocab_size, (B,), dtype=np.int32)
            for i in range(warmup + steps):
                position = min(P + i, S - 1)
                batch = jax.device_put({"tokens": np.asarray(tokens, np.int32),
                                        "positions": np.full((B,), position, np.int32)}, batch_shardings)
                jax.block_until_ready(batch)
                t = time.perf_counter()
                cache, produced = step(params, cache, batch)
                jax.block_until_ready((cache, produced))
                if i >= warmup:
                    times.append(time.perf_counter() - t)
                tokens = np.asarray(jax.device_get(produced))
            tokens_per_step = B
        median = statistics.median(times)
        estimate = artifact.json("estimate.json") or {}
        predicted = estimate.get("prefill", {}).get("seconds") if kind == serving.PREFILL else estimate.get(
            "time_per_output_token_s")
        hlo = (estimate.get("hlo_time") or {}).get("step_time_s")
        result = {
            "schema": SCHEMA, "step": kind, "model": p.model.name, "topology": p.topology.name,
            "platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices),
            "batch": B, "prompt_tokens": P, "cache_positions": S, "steps": len(times), "warmup": warmup,
            "step_times_s": times, "step_time_s": median, "step_time_min_s": min(times),
            "tokens_per_s": tokens_per_step / median,
            "tokens_per_s_per_chip": tokens_per_step / median / p.topology.chips,
            "predicted_step_time_s": predicted, "measured_over_predicted": median / predicted if predicted else None,
            "predicted_basis": ("perfmodel.serving: the batch's prefill" if kind == serving.PREFILL else
                                "perfmodel.serving: a decode step at the middle of generation, reading the filled "
                                "positions only"),
            "hlo_predicted_step_time_s": hlo, "measured_over_hlo_predicted": median / hlo if hlo else None,
            "memory_compiler_per_device_bytes": (artifact.json("memory.json") or {}).get("per_device_total_bytes"),
            "artifact": str(artifact.directory.resolve()),
            "artifact_sha256": artifact.manifest.get("files", {}).get("compiled.pkl"),
        }
        writer.write_text("run.json", json.dumps(result, indent=2, allow_nan=False) + "\n")
        writer.commit()
    except BaseException:
        writer.abandon()
        raise
    return result
