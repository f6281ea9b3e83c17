"""A user's step through maxperf (`--step MODULE:FACTORY`): reading the option, the factory's words, the checks
of what a factory returns, every kind of bad input as one line with exit 2 and nothing written, and the example
step compiled for TPU, GPU and CPU topologies and run on cpu-8 against its HLO-derived prediction."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_util import maxperf
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxperf.aot import targets, user_step
from maxperf.aot.user_step import Step, UserStepError
from maxperf.spec import steps
from maxperf.spec import topology as topologies
from maxperf.spec.errors import MaxperfError
from maxperf.spec.parallelism import ParallelismConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples.vision_step:make_step"


@pytest.fixture
def mesh():
    topo = topologies.get("cpu-8")
    from maxperf.spec import mesh as mesh_mod

    return targets.jax_mesh(topo, mesh_mod.resolve(ParallelismConfig(), topo))


def test_step_values_are_builtin_names_or_user_factories(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert steps.parse_step("train").builtin == "train"
    assert steps.parse_step("pkg.mod:fn") == steps.StepName(module="pkg.mod", factory="fn")
    assert steps.parse_step("path/to/file.py:fn").module == "path/to/file.py"
    named = steps.parse_step("examples.vision_step")  # an importable module: its make_step
    assert named.is_user and named.factory == steps.DEFAULT_FACTORY
    for bad in ("prefil", "pkg.mod:", ":fn", "pkg:not-a-name"):
        with pytest.raises(MaxperfError, match="--step"):
            steps.parse_step(bad)


def test_mesh_words_size_the_mesh_and_the_others_go_to_the_factory():
    request = steps.resolve_user("cpu-8", "m:f", ["ici_tensor=2", "batch=64", "ici_fsdp_parallelism=4", "lr=0.1"])
    assert request.mesh.axes["tensor"] == 2 and request.mesh.axes["fsdp"] == 4
    assert request.args == {"batch": "64", "lr": "0.1"}
    assert "ici_tensor=2" in request.words and "batch=64" in request.words
    with pytest.raises(MaxperfError, match="given twice"):
        steps.resolve_user("cpu-8", "m:f", ["batch=1", "batch=2"])
    with pytest.raises(MaxperfError, match="not key=value"):
        steps.resolve_user("cpu-8", "m:f", ["batch"])
    with pytest.raises(MaxperfError, match="multiply"):
        steps.resolve_user("cpu-8", "m:f", ["ici_tensor=3"])
    with pytest.raises(MaxperfError, match="maxperf's own step"):
        steps.resolve_user("cpu-8", "train")


def factory(mesh, batch: int = 8, rate=0.5, name="x", flag: bool = False, *, layers: int):
    return (batch, rate, name, flag, layers)


def test_words_take_the_types_of_the_factorys_parameters():
    name = steps.StepName(module="m", factory="factory")
    got = user_step.factory_arguments(factory, name, {"batch": "64", "rate": "1e-3", "name": "y", "flag": "true",
                                                      "layers": "2"})
    assert got == {"batch": 64, "rate": 1e-3, "name": "y", "flag": True, "layers": 2}
    with pytest.raises(UserStepError, match="did you mean batch"):
        user_step.factory_arguments(factory, name, {"btch": "1", "layers": "1"})
    with pytest.raises(UserStepError, match="an integer"):
        user_step.factory_arguments(factory, name, {"batch": "many", "layers": "1"})
    with pytest.raises(UserStepError, match="give layers="):
        user_step.factory_arguments(factory, name, {})


def abstract(mesh, spec=P()):
    return jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, spec))


def test_a_checked_step_has_every_argument_sharded_over_the_mesh(mesh):
    args = (abstract(mesh, P("fsdp")), jax.ShapeDtypeStruct((8,), jnp.int32),
            jax.ShapeDtypeStruct((8,), jnp.int32, sharding=P("fsdp")))
    step = user_step.check(Step(fn=lambda a, b, c: a, args=args), mesh, "m:f")
    a, b, c = step.args
    assert a.sharding.spec == P("fsdp")
    assert b.sharding == NamedSharding(mesh, P()) and c.sharding == NamedSharding(mesh, P("fsdp"))
    assert step.name == "m:f"


@pytest.mark.parametrize("make, needle", [
    (lambda mesh: {"fn": None}, "not a maxperf Step"),
    (lambda mesh: Step(fn=3, args=()), "not the step function"),
    (lambda mesh: Step(fn=abs, args=(jnp.zeros((8, 4)),)), "Step.args[0] is a concrete"),
    (lambda mesh: Step(fn=abs, args=({"x": np.zeros(3)},)), "Step.args[0]['x'] is a concrete ndarray"),
    (lambda mesh: Step(fn=abs, args=("text",)), "not a jax.ShapeDtypeStruct"),
    (lambda mesh: Step(fn=abs, args=(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=P("batch")),)),
     "an axis the mesh lacks"),
    (lambda mesh: Step(fn=abs, args=(jax.ShapeDtypeStruct(
        (8,), jnp.float32, sharding=NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",)), P())),)),
     "other devices"),
    (lambda mesh: Step(fn=abs, args=(abstract(mesh),), donate=(1,)), "not an index"),
    (lambda mesh: Step(fn=abs, args=(abstract(mesh),), model_flops=-1.0), "positive number"),
    (lambda mesh: Step(fn=abs, args=(abstract(mesh),), init=5), "Step.init should be a function"),
])
def test_what_a_factory_must_not_return(mesh, make, needle):
    with pytest.raises(UserStepError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        user_step.check(make(mesh), mesh, "m:f")


BAD_STEPS = '''
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from maxperf.aot.user_step import Step


def raises(mesh):
    raise ValueError("the factory's own failure")


def wrong_type(mesh):
    return {"fn": None}


def concrete(mesh):
    return Step(fn=lambda x: x * 2, args=(jnp.zeros((8, 4)),))


def missing_axis(mesh):
    return Step(fn=lambda x: x * 2, args=(jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=P("batch")),))


def fails_to_trace(mesh):
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    return Step(fn=lambda x: x @ x, args=(x,))
'''


@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_nothing_written_and_the_traceback_only_with_verbose(tmp_path):
    module = tmp_path / "bad_steps.py"
    module.write_text(BAD_STEPS)
    work = tmp_path / "work"
    work.mkdir()
    cases = [(f"{module}:raises", "the factory's own failure"), (f"{module}:wrong_type", "not a maxperf Step"),
             (f"{module}:concrete", "is a concrete"), (f"{module}:missing_axis", "an axis the mesh lacks"),
             (f"{module}:fails_to_trace", "tracing or lowering"), (f"{module}:absent", "has no 'absent'"),
             ("no_such_module_here:make", "importing no_such_module_here failed")]
    for step, needle in cases:
        proc = maxperf("compile", "--step", step, "--topology", "cpu-8", "--out", str(work / "out"), cwd=work)
        assert proc.returncode == 2, (step, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith("maxperf: error:") and needle in lines[-1], (step, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert not any(work.iterdir()), list(work.iterdir())  # nothing written, no lock or partial directory
    verbose = maxperf("compile", "--step", f"{module}:raises", "--topology", "cpu-8", "--verbose", cwd=work)
    assert verbose.returncode == 2
    assert "Traceback" in verbose.stderr and 'raise ValueError("the factory' in verbose.stderr
    assert verbose.stderr.strip().splitlines()[-1].startswith("maxperf: error:")
    with_model = maxperf("compile", "--step", EXAMPLE, "--model", "tiny", "--topology", "cpu-8", cwd=ROOT)
    assert with_model.returncode == 2 and "drop --model" in with_model.stderr
    # a sweep checks the factory's import and its words before any point: the same one line, nothing written
    for step, words, needle in [(EXAMPLE, ["widht=8,16"], "has no parameter 'widht'; did you mean width?"),
                                ("no_such_module_here:make", [], "importing no_such_module_here failed")]:
        proc = maxperf("sweep", "--step", step, "--topologies", "cpu-2", *words, "--out", str(work / "sweep"),
                       cwd=ROOT)
        assert proc.returncode == 2 and needle in proc.stderr.strip().splitlines()[-1], (step, proc.stderr)
        assert not any(work.iterdir()), list(work.iterdir())


@pytest.mark.slow
def test_the_example_compiles_and_runs_on_cpu_8_against_its_hlo_prediction(tmp_path):
    out, run = tmp_path / "vision", tmp_path / "run"
    compiled = maxperf("compile", "--step", EXAMPLE, "--topology", "cpu-8", "per_device_batch=4", "width=8",
                       "image_size=16", "--out", str(out), "--json", cwd=ROOT)
    assert compiled.returncode == 0, compiled.stderr
    summary = json.loads(compiled.stdout)
    assert summary["step"] == EXAMPLE and summary["args"] == {"per_device_batch": "4", "width": "8",
                                                              "image_size": "16"}
    estimate = json.loads((out / "estimate.json").read_text())
    assert estimate["schema"] == "maxperf.hlo-estimate/1" and estimate["unit"] == "images"
    assert estimate["step_time_s"] == estimate["hlo_time"]["step_time_s"] > 0
    assert estimate["tokens_per_s"] == pytest.approx(32 / estimate["step_time_s"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["step"]["factory"] == EXAMPLE and manifest["tokens_per_step"] == 32
    ran = maxperf("run", str(out), "--steps", "3", "--warmup", "1", "--out", str(run), "--json", cwd=ROOT)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["step"] == EXAMPLE and result["unit"] == "images" and result["steps"] == 3
    assert result["hlo_predicted_step_time_s"] == estimate["step_time_s"]
    assert result["measured_over_hlo_predicted"] == pytest.approx(result["step_time_s"] / estimate["step_time_s"])
    assert len(result["losses"]) == 3 and all(np.isfinite(result["losses"]))
    assert json.loads((run / "run.json").read_text())["step_time_s"] == result["step_time_s"]
    assert not any("Step.model_flops is" in n for n in estimate["notes"])  # the example's figure is right
    # an MFU above 100% is said to be no utilization (the CPU's uncalibrated peak is below what it runs at)
    above = [n for n in result["notes"] if "is above 100%" in n]
    assert bool(above) == (result["mfu"] > 1), (result["mfu"], result["notes"])


def test_model_flops_above_what_the_program_computes_are_noted():
    from maxperf.aot.user_compile import model_flops_check

    assert model_flops_check(5.6e9, 5.0e9) == []  # 3 x the forward, the first layer's input gradient uncomputed
    (note,) = model_flops_check(2 * 5.0e9 * 1.2, 5.0e9)  # the whole step's given where a device's was meant
    assert "2.4 times the 5e+09" in note
    (note,) = model_flops_check(5e17, 0.0)
    assert "more than the 0 the compiled program's" in note


RUN_STEPS = '''
import jax
import jax.numpy as jnp

from maxperf.aot.user_step import Step

S = jax.ShapeDtypeStruct((8, 8), jnp.float32)


def wrong_init(mesh):
    return Step(fn=lambda x: x @ x, args=(S,), init=lambda seed: (jnp.ones((4, 4)),))


def broken_loss(mesh):
    return Step(fn=lambda x: x @ x, args=(S,), init=lambda seed: (jnp.ones((8, 8)),), loss=lambda out: out["nope"])


def broken_carry(mesh):
    return Step(fn=lambda x: x @ x, args=(S,), init=lambda seed: (jnp.ones((8, 8)),),
                carry=lambda args, out: (out.astype(jnp.bfloat16),))


def timed_loss(mesh):
    import time

    def slow_loss(out):
        time.sleep(0.5)
        return out[0, 0]

    return Step(fn=lambda x: x @ x, args=(S,), init=lambda seed: (jnp.ones((8, 8)) / 8,), loss=slow_loss,
                model_flops=2 * 8 ** 3, tokens_per_step=8)


def printing(mesh):
    def step(x):
        jax.debug.print("x {}", x[0, 0])
        return x @ x

    print("made by the factory")
    return Step(fn=step, args=(S,))
'''


def test_run_names_the_step_function_that_made_a_bad_argument_or_failed(tmp_path):
    """Step.init, Step.loss and Step.carry are the user's code: `maxperf run` says which one failed or made an
    argument the executable was not compiled for, in one line, exit 2, nothing written."""
    (tmp_path / "run_steps.py").write_text(RUN_STEPS)
    for factory, needle in [("wrong_init", "Step.init of --step run_steps:wrong_init made argument 0 as "
                                           "float32[4, 4]; the step was compiled for float32[8, 8]"),
                            ("broken_loss", "Step.loss of --step run_steps:broken_loss raised TypeError"),
                            ("broken_carry", "Step.carry of --step run_steps:broken_carry made argument 0 as "
                                             "bfloat16[8, 8]")]:
        out = tmp_path / factory
        compiled = maxperf("compile", "--step", f"run_steps:{factory}", "--topology", "cpu-2", "--out", str(out),
                           cwd=tmp_path)
        assert compiled.returncode == 0, compiled.stderr
        ran = maxperf("run", str(out), "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "ran"), cwd=tmp_path)
        assert ran.returncode == 2 and needle in ran.stderr.strip().splitlines()[-1], (factory, ran.stderr)
        assert "Traceback" not in ran.stderr and not (tmp_path / "ran").exists()


def test_an_mfu_above_100_percent_is_noted_as_a_wrong_peak_or_wrong_flops():
    from maxperf.profiler.run import impossible_mfu

    assert impossible_mfu(None, "published") == [] and impossible_mfu(0.62, "published") == []
    (note,) = impossible_mfu(2.857, "uncalibrated defaults (run `maxperf calibrate`)")
    assert note.startswith("MFU 285.7% is above 100%") and note.count("maxperf calibrate") == 1
    (note,) = impossible_mfu(1.2, "published")
    assert "model FLOPs counted are more than the step computes" in note and "`maxperf calibrate`" in note


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5p-256", "h100-8x2"])
def test_the_example_compiles_for_a_tpu_and_a_gpu_topology(tmp_path, topology, monkeypatch):
    from maxperf.aot import user_compile

    monkeypatch.chdir(ROOT)
    result = user_compile.compile_step(topology, EXAMPLE, ["per_device_batch=8"], out=tmp_path / "out")
    assert result.fits
    hlo = result.estimate["hlo_time"]
    assert hlo["step_time_s"] > 0 and hlo["flops_per_device"] > 0
    assert result.estimate["mfu"] is not None and 0 < result.estimate["mfu"] < 1
    devices = topologies.get(topology).num_devices
    assert result.step.tokens_per_step == 8 * devices
    assert any(op["kind"] == "collective" for op in hlo["top"]) or hlo["ici_s"] + hlo["dcn_s"] > 0


def test_maxtexts_step_takes_maxperfs_mesh_as_maxtexts_parallelism_keys():
    from maxperf.integrations import maxtext_step
    from maxperf.spec import mesh as mesh_mod

    topo = topologies.get("cpu-8")
    mesh = targets.jax_mesh(topo, mesh_mod.resolve(ParallelismConfig(ici_fsdp=4, ici_tensor=2), topo))
    words = maxtext_step.mesh_words(mesh)
    assert "ici_fsdp_parallelism=4" in words and "ici_tensor_parallelism=2" in words
    assert "ici_context_parallelism=1" in words  # maxperf's sequence axis is MaxText's context
    assert all(w.endswith("=1") for w in words if w.startswith("dcn_"))  # one slice


@pytest.mark.skipif(__import__("importlib").util.find_spec("maxtext") is not None,
                    reason="MaxText is installed here: the step builds")
def test_maxtexts_step_without_maxtext_says_how_to_install_it(mesh):
    name = steps.StepName(module="maxperf.integrations.maxtext_step", factory="make_step")
    with pytest.raises(UserStepError, match=r"MaxText is not installed here: install MaxText beside maxperf"):
        user_step.make_step(name, mesh, {"model_name": "llama2-7b"})


def test_optional_factory_parameters_take_their_type():
    """A factory's `Optional[int]`, `int | None` and `Union[float, None]` parameters receive an int and a float, not
    the text of the word (which traced into a confusing jax error)."""
    import inspect
    from typing import Optional, Union

    def factory(mesh, a: Optional[int] = None, b: int | None = None, c: Union[float, None] = None,  # noqa: UP007
                d: "Optional[int]" = None):  # noqa: UP037
        return None

    kinds = {n: user_step._parameter_type(p) for n, p in inspect.signature(factory).parameters.items() if n != "mesh"}
    assert kinds == {"a": int, "b": int, "c": float, "d": int}


def test_a_default_carry_refuses_a_donated_batch_before_the_first_step():
    """A step that donates an argument besides its state would be fed that consumed buffer again by the default
    carry (a jax runtime error about a deleted buffer, exit 1): refused at once, in one line."""
    from maxperf.profiler.user_run import default_carry

    step = user_step.Step(fn=lambda s, b: (s, b), args=(jax.ShapeDtypeStruct((2,), jnp.float32),) * 2, donate=(0, 1))
    with pytest.raises(user_step.UserStepError, match=r"donates argument\(s\) \[1\]"):
        default_carry(step, "m:f")


def test_a_default_carry_does_not_feed_a_loss_back_as_the_state():
    """A non-donating `(w, x) -> (loss, grad)` step: the scalar loss has the tree of a one-array w, but not its shape,
    so the step takes its own arguments again rather than the loss as w."""
    from maxperf.profiler.user_run import default_carry

    w, x = jnp.ones((4,)), jnp.ones((4,))
    step = user_step.Step(fn=lambda w, x: (jnp.sum(w * x), x), args=(jax.ShapeDtypeStruct((4,), jnp.float32),) * 2)
    carried = default_carry(step, "m:f")((w, x), (jnp.float32(1.0), x))
    assert carried[0].shape == (4,)


def test_a_sweep_point_of_a_user_step_is_keyed_by_its_factorys_source(tmp_path, monkeypatch):
    """The same words over a changed factory are another step: its sweep point is computed again, not resumed."""
    from maxperf.search.sweep import Point, point_key

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keyed_step.py").write_text("def make_step(mesh, layers: int = 2):\n    return None\n")
    point = Point("cpu-1", 1, ("d=64",))
    before = point_key("keyed_step:make_step", point, False)
    (tmp_path / "keyed_step.py").write_text("def make_step(mesh, layers: int = 8):\n    return None\n")
    after = point_key("keyed_step:make_step", point, False)
    assert before["step_source_sha256"] and before != after


def test_run_times_the_step_not_its_loss_and_a_host_callback_step_keeps_its_memory(tmp_path):
    """Step.loss is the user's host code: read after each step's time is taken (a 0.5 s loss made a 0.5 s step). A
    step with a host callback (jax.debug.print) compiles, but its executable does not pickle: compile writes the
    memory and HLO and exits 2 in one line; estimate-memory gives the compiler's memory; a factory's prints go to
    stderr, so --json's stdout stays one document."""
    (tmp_path / "run_steps.py").write_text(RUN_STEPS)
    out = tmp_path / "timed"
    assert maxperf("compile", "--step", "run_steps:timed_loss", "--topology", "cpu-1", "--out", str(out),
                   cwd=tmp_path).returncode == 0
    ran = maxperf("run", str(out), "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "ran"), "--json",
                  cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert max(result["step_times_s"]) < 0.25 and len(result["losses"]) == 2

    printed = maxperf("compile", "--step", "run_steps:printing", "--topology", "cpu-1", "--out", str(tmp_path / "p"),
                      "--json", cwd=tmp_path)
    assert printed.returncode == 2 and "made by the factory" not in printed.stdout
    assert json.loads(printed.stdout)["error"].startswith("jax cannot serialize the compiled step")
    assert (tmp_path / "p" / "memory.json").is_file() and not (tmp_path / "p" / "compiled.pkl").exists()
    memory = maxperf("estimate-memory", "--step", "run_steps:printing", "--topology", "cpu-1", "--json",
                     cwd=tmp_path)
    assert memory.returncode == 0, memory.stderr
    assert json.loads(memory.stdout)["fits"] is True
