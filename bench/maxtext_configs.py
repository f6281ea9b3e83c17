"""MaxText's published TPU training configs, compiled by maxperf with their flags pasted as they are.

    .venv/bin/python bench/maxtext_configs.py                    # every config (about half an hour on 2 cores)
    .venv/bin/python bench/maxtext_configs.py v5p/32b v6e        # those whose path starts so
    .venv/bin/python bench/maxtext_configs.py --list             # the maxperf command of each, no compile
    .venv/bin/python bench/maxtext_configs.py --json rows.json   # the rows as JSON too

The configs are the `configs/tpu/{v5p,v5e,v6e}/` scripts of the `maxtext` package (PyPI, Apache-2.0), read from the
package installed in --venv (default /tmp/peer; `bash shared/peer/maxtext_aot.sh` creates that venv with
`maxtext[tpu]==0.2.5`) or from --configs DIR, a copy of that `tpu` folder. Each script's train command is read as
bash would run it with no arguments: backslash-newlines joined, `$VAR`, `${VAR}` and `${VAR:-default}` expanded
from the script's own assignments (and from the arguments a wrapper script passes to the base script it calls).

From the command's `key=value` flags: `model_name=M` becomes `--model M`, `global_parameter_scale=S` (MaxText's
synthetic models) `--model scaled-S`, and neither MaxText's default, `scaled-1`. Flags that do not change the
compiled step (where outputs go, the input pipeline, how many steps, checkpoints, metrics, the profiler) are
dropped, each with its reason; every other flag goes to maxperf as written. The topology is the smallest production
one the script states ("any number of v5p-128 slices": one v5p-128; "on 1 x v5p-512": one v5p-512).

Each config is one `maxperf compile --topology T --model M key=value ... --json` process, one at a time, with the
compile cache off (MAXPERF_NO_CACHE=1). A row gives whether the step fits, its memory per device against HBM (XLA's
memory analysis: arguments + outputs - aliases + temporaries), and the compile's seconds (lowering excluded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402

DEFAULT_VENV = Path("/tmp/peer")
PLATFORMS = ("v5p", "v5e", "v6e")
SCHEMA = "maxperf.bench.maxtext_configs/1"

# MaxText flags with no effect on the compiled train step, and why.
NO_EFFECT = {
    "run_name": "names the run's outputs",
    "base_output_directory": "where outputs go",
    "dataset_type": "the input pipeline; the step takes token arrays",
    "dataset_path": "the input pipeline; the step takes token arrays",
    "tokenizer_path": "the input pipeline; the step takes token arrays",
    "reuse_example_batch": "the input pipeline (one batch fed again); the step is the same",
    "steps": "how many steps run; one step is compiled",
    "enable_checkpointing": "checkpoints are saved outside the step",
    "async_checkpointing": "checkpoints are saved outside the step",
    "gcs_metrics": "metrics are written outside the step",
    "profiler": "profiling is outside the step",
    "skip_first_n_steps_for_profiler": "profiling is outside the step",
    "profiler_steps": "profiling is outside the step",
}
MODEL_KEYS = ("model_name", "global_parameter_scale")
TOPOLOGY_KEYS = ("compile_topology", "compile_topology_num_slices")


@dataclass(frozen=True)
class Config:
    """One MaxText config and the maxperf compile it becomes."""

    path: str  # relative to the tpu folder, e.g. v5p/32b.sh
    model: str | None = None  # the maxperf preset
    topology: str | None = None
    num_slices: int = 1
    flags: tuple[str, ...] = ()  # key=value passed to maxperf as written
    dropped: tuple[tuple[str, str], ...] = ()  # (key=value, why)
    skip: str | None = None  # why it is not compiled
    libtpu_args: str = ""  # the LIBTPU_INIT_ARGS the script exports (XLA TPU compiler flags)

    def argv(self) -> list[str]:
        """`maxperf compile`'s arguments for this config."""
        out = ["compile", "--topology", self.topology, "--model", self.model]
        if self.num_slices > 1:
            out += ["--num-slices", str(self.num_slices)]
        return [*out, *self.flags, "--json"]


# ------------------------------------------------------------------ reading a script as bash would


def _expand(text: str, env: dict[str, str]) -> str:
    """`text` with `$NAME`, `${NAME}` and `${NAME:-word}` (word expanded in turn) replaced from `env`; an unset
    name without a default expands to nothing, as in bash."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and text.startswith("${", i):
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            body = text[i + 2:j - 1]
            name, sep, default = body.partition(":-")
            value = env.get(name, "")
            out.append(value if value or not sep else _expand(default, env))
            i = j
        elif text[i] == "$" and (m := re.match(r"\$([A-Za-z_][A-Za-z0-9_]*|[0-9])", text[i:])):
            out.append(env.get(m.group(1), ""))
            i += m.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _logical_lines(text: str) -> list[str]:
    """The script's lines with backslash-newlines joined and comment lines removed."""
    lines = [line for line in text.replace("\\\n", "").splitlines() if not line.lstrip().startswith("#")]
    return [line.strip() for line in lines if line.strip()]


_ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def _environment(lines: list[str], positional: list[str]) -> dict[str, str]:
    """The variables the script assigns before its train command, positional arguments as $1, $2, ..."""
    env = {str(i + 1): arg for i, arg in enumerate(positional)}
    for line in lines:
        if "maxtext.trainers" in line:
            break
        m = _ASSIGNMENT.match(line)
        if m:
            words = shlex.split(_expand(m.group(2), env), comments=True) or [""]
            env[m.group(1)] = words[0]
    return env


def train_command(text: str, positional: list[str] = ()) -> list[str] | None:
    """The `key=value` words of the script's last `python3 -m maxtext.trainers...` command, expanded."""
    lines = _logical_lines(text)
    env = _environment(lines, list(positional))
    commands = [line for line in lines if re.search(r"-m\s+maxtext\.trainers\.", line)]
    if not commands:
        return None
    words = shlex.split(_expand(commands[-1], env))
    return [w for w in words if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]


def libtpu_args(text: str, positional: list[str] = ()) -> str:
    """The LIBTPU_INIT_ARGS the script exports before its train command ("" if none)."""
    return _environment(_logical_lines(text), list(positional)).get("LIBTPU_INIT_ARGS", "")


_SCRIPT_CALL = re.compile(r"^\S*/([A-Za-z0-9_]+\.sh)\s+(.*)$")


def _called_script(text: str, folder: Path) -> tuple[Path, list[str]] | None:
    """(the script beside this one that it runs, its arguments), for a wrapper such as gpt3_175b/v5p_1024.sh."""
    lines = _logical_lines(text)
    for line in lines:
        m = _SCRIPT_CALL.match(line)
        if m and (folder / m.group(1)).exists() and not line.startswith("chmod"):
            env = _environment(lines, [])
            return folder / m.group(1), shlex.split(_expand(m.group(2), env))
    return None


def stated_topology(text: str) -> tuple[str, int] | None:
    """The smallest production topology the script's comments state: (name, slices)."""
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    m = re.search(r"any number of (?:trillium|(v\d[a-z]?))-(\d+)", comments)
    if m:
        return f"{m.group(1) or 'v6e'}-{m.group(2)}", 1
    m = re.search(r"on (\d+) x (v\d[a-z]?-\d+)", comments)
    if m:
        return m.group(2), int(m.group(1))
    m = re.search(r"on (v\d[a-z]?-\d+) slice", comments)
    if m:
        return m.group(1), 1
    m = re.search(r"M_COMPILE_TOPOLOGY=(\S+)", comments)
    if m:
        return m.group(1), 1
    return None


def _presets() -> set[str]:
    sys.path.insert(0, str(ROOT))
    from maxperf.spec import presets

    return set(presets.names())


def parse(path: Path, tpu_dir: Path, presets: set[str] | None = None) -> Config:
    """The maxperf compile a MaxText script becomes."""
    presets = _presets() if presets is None else presets
    name = str(path.relative_to(tpu_dir))
    if path.suffix in (".yml", ".yaml"):
        base = re.search(r"^base_config:\s*\"?([^\"\s]+)", path.read_text(), re.M)
        if base and "inference" in base.group(1):
            return Config(name, skip=f"an inference config (base_config {base.group(1)}), no train step")
        return Config(name, skip="a yml config; only the train scripts are read")
    text = path.read_text()
    called = _called_script(text, path.parent)
    script, positional = (called[0].read_text(), called[1]) if called else (text, [])
    words = train_command(script, positional)
    if words is None:
        return Config(name, skip="no maxtext train command in the script")
    topology = stated_topology(text)
    if topology is None:
        return Config(name, skip="the script states no topology")
    model, flags, dropped = "scaled-1", [], []
    topology_name, slices = topology
    for word in words:
        key, _, value = word.partition("=")
        if key == "model_name":
            model = value
        elif key == "global_parameter_scale":
            model = f"scaled-{int(value)}"
        elif key in TOPOLOGY_KEYS:
            dropped.append((word, "the topology is the one the script states, passed as --topology"))
        elif key in NO_EFFECT:
            dropped.append((word, NO_EFFECT[key]))
        elif key == "quantization" and value == "":
            dropped.append((word, "empty: no quantization, MaxText's default and maxperf's"))
        else:
            flags.append(word)
    config = Config(name, model, topology_name, slices, tuple(flags), tuple(dropped),
                    libtpu_args=libtpu_args(script, positional))
    if model not in presets:
        moe = model.startswith(("mixtral", "deepseek", "qwen3-moe", "llama4", "gpt-oss"))
        return dataclasses.replace(config, skip="MoE: pending" if moe else f"no maxperf preset {model}")
    return config


def find_tpu_dir(venv: Path) -> Path:
    """The `configs/tpu` folder of the maxtext package installed in `venv`."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no python in {venv}; `bash shared/peer/maxtext_aot.sh` installs MaxText into /tmp/peer, "
                         f"or pass --configs DIR")
    proc = subprocess.run([str(python), "-c", "import importlib.util as u; "
                           "print(u.find_spec('maxtext').submodule_search_locations[0])"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"maxtext is not installed in {venv}; `bash shared/peer/maxtext_aot.sh` installs it")
    return Path(proc.stdout.strip()) / "configs" / "tpu"


def configs(tpu_dir: Path) -> list[Config]:
    """Every config of the v5p, v5e and v6e folders; of a folder of wrapper scripts around one base script (v5p's
    gpt3_175b), the wrapper with the smallest topology."""
    presets = _presets()
    out = []
    for platform in PLATFORMS:
        folder = tpu_dir / platform
        for path in sorted(folder.iterdir()) if folder.is_dir() else ():
            if path.is_file() and path.suffix in (".sh", ".yml", ".yaml"):
                out.append(parse(path, tpu_dir, presets))
            elif path.is_dir():
                wrappers = [parse(p, tpu_dir, presets) for p in sorted(path.glob("*.sh"))
                            if _called_script(p.read_text(), path)]
                compiled = [c for c in wrappers if c.topology]
                if compiled:
                    out.append(min(compiled, key=lambda c: int(c.topology.split("-")[1]) * c.num_slices))
    return out


# ------------------------------------------------------------------ compiling


@dataclass(frozen=True)
class Row:
    config: Config
    fits: bool | None = None
    memory_bytes: int | None = None
    hbm_bytes: int | None = None
    compile_seconds: float | None = None
    wall_seconds: float | None = None
    error: str | None = None


def compile_one(config: Config, work: Path, with_libtpu_args: bool = False) -> Row:
    python = os.environ.get("MAXPERF_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    out = work / config.path.replace("/", "_")
    argv = [python, "-m", "maxperf.cli", *config.argv()[:-1], "--out", str(out), "--force", "--json"]
    env = {**os.environ, "MAXPERF_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    if with_libtpu_args and config.libtpu_args:
        env["LIBTPU_INIT_ARGS"] = config.libtpu_args
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    try:
        summary = json.loads(proc.stdout) if proc.returncode in (0, 3) else None
    except json.JSONDecodeError:
        summary = None
    if summary is None and proc.returncode == 3 and (out / "memory.json").exists():
        # the compiler ran out of HBM: no executable and no summary, but the memory it needed
        memory = json.loads((out / "memory.json").read_text())
        return Row(config, False, memory["per_device_total_bytes"], memory["hbm_bytes"], None, wall)
    if summary is None:
        lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
        return Row(config, wall_seconds=wall, error=f"exit {proc.returncode}: {lines[-1][:300]}")
    memory = summary["memory"]
    return Row(config, summary["fits"], memory["per_device_total_bytes"], memory["hbm_bytes"],
               summary["compile_seconds"], wall)


def _gib(n: int | None) -> str:
    return f"{n / GIB:.2f}" if n is not None else "-"


def _seconds(s: float | None) -> str:
    return f"{s:.1f} s" if s is not None else "- (out of HBM)"


def print_row(row: Row) -> None:
    c = row.config
    where = f"{c.topology}" + (f" x {c.num_slices}" if c.num_slices > 1 else "") if c.topology else "-"
    if c.skip:
        status = c.skip
    elif row.error:
        status = f"FAILED: {row.error}"
    else:
        status = (f"{'fits' if row.fits else 'DOES NOT FIT'}, {_gib(row.memory_bytes)} / {_gib(row.hbm_bytes)} GiB, "
                  f"compile {_seconds(row.compile_seconds)} (process {row.wall_seconds:.1f} s)")
    print(f"{c.path:<26} {c.model or '-':<14} {where:<10} {status}", flush=True)
    if c.topology and not c.skip:
        print(f"    flags: {' '.join(c.flags)}", flush=True)
        for word, why in c.dropped:
            print(f"    dropped {word}: {why}", flush=True)


def markdown(rows: list[Row]) -> str:
    out = ["| config | model | topology | fits | memory / HBM (GiB) | compile | flags passed |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        c = row.config
        where = (c.topology + (f" x {c.num_slices}" if c.num_slices > 1 else "")) if c.topology else "-"
        if c.skip or row.error:
            fits, mem, secs = (c.skip or f"failed: {row.error}"), "-", "-"
        else:
            fits = "yes" if row.fits else "**no**"
            mem, secs = f"{_gib(row.memory_bytes)} / {_gib(row.hbm_bytes)}", _seconds(row.compile_seconds)
        out.append(f"| {c.path} | {c.model or '-'} | {where} | {fits} | {mem} | {secs} | "
                   f"{' '.join(c.flags) or '-'} |")
    return "\n".join(out)


def to_json(rows: list[Row]) -> dict:
    return {"schema": SCHEMA, "rows": [{
        "config": r.config.path, "model": r.config.model, "topology": r.config.topology,
        "num_slices": r.config.num_slices, "flags": list(r.config.flags),
        "dropped": [{"flag": w, "why": why} for w, why in r.config.dropped], "skip": r.config.skip,
        "fits": r.fits, "per_device_total_bytes": r.memory_bytes, "hbm_bytes": r.hbm_bytes,
        "compile_seconds": r.compile_seconds, "wall_seconds": r.wall_seconds, "error": r.error,
    } for r in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="configs whose path (e.g. v5p/32b) starts with one of these")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="a venv with maxtext installed")
    parser.add_argument("--configs", type=Path, help="MaxText's configs/tpu folder, instead of --venv's")
    parser.add_argument("--list", action="store_true", help="print each config's maxperf command, compile nothing")
    parser.add_argument("--json", type=Path, help="write the rows to this JSON file too")
    parser.add_argument("--with-libtpu-args", action="store_true",
                        help="compile under each script's LIBTPU_INIT_ARGS (its XLA flags, e.g. a larger scoped VMEM)")
    args = parser.parse_args(argv)
    args.json = outfile.checked(parser, args.json)
    tpu_dir = args.configs or find_tpu_dir(args.venv)
    chosen = [c for c in configs(tpu_dir) if not args.only or any(c.path.startswith(o) for o in args.only)]
    print(f"MaxText configs: {tpu_dir}", flush=True)
    if args.list:
        for c in chosen:
            line = c.skip or "maxperf " + shlex.join(c.argv())
            print(f"{c.path}: {line}")
            for word, why in c.dropped:
                print(f"    dropped {word}: {why}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="maxtext-configs-") as work:
        for c in chosen:
            row = Row(c) if c.skip else compile_one(c, Path(work), args.with_libtpu_args)
            print_row(row)
            rows.append(row)
            if args.json:
                outfile.write(args.json, to_json(rows), indent=2)
    print()
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
