"""`maxperf.aot.load()`: read an artifact directory back, checking hashes, versions and what it may unpickle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxperf.aot import artifacts
from maxperf.aot.artifacts import ArtifactError
from maxperf.aot.compiler import library_versions, versions_that_must_match
from maxperf.spec import topology as topologies
from maxperf.spec.configs import Configs, from_dict
from maxperf.spec.mesh import Mesh
from maxperf.spec.model import ModelConfig
from maxperf.spec.parallelism import ParallelismConfig
from maxperf.spec.request import Request
from maxperf.spec.steps import StepName, UserRequest
from maxperf.spec.topology import Topology
from maxperf.spec.train import TrainConfig


@dataclass(frozen=True)
class Artifact:
    directory: Path
    manifest: dict
    plan: Request | None  # maxperf's own step; None for a user's step (`user`)
    payload: bytes  # jax's serialized executable, already checked
    in_tree: str
    out_tree: str
    user: UserRequest | None = None  # a user's step (`maxperf compile --step MODULE:FACTORY`)

    @property
    def topology(self) -> Topology:
        return self.user.topology if self.user is not None else self.plan.topology

    @property
    def mesh(self) -> Mesh:
        return self.user.mesh if self.user is not None else self.plan.mesh

    def json(self, name: str) -> dict | None:
        """Another JSON file of the artifact (memory.json, cost.json, estimate.json), if it was written."""
        import json

        path = self.directory / name
        return json.loads(path.read_text()) if path.is_file() else None

    def step(self, device_list=None):
        """(AbstractStep over `device_list`, the loaded executable) on this process's devices."""
        import jax

        from maxperf.aot import peak, targets
        from maxperf.models import train_step

        device_list = list(device_list) if device_list is not None else jax.devices()
        mesh = targets.jax_mesh(self.plan.topology, self.plan.mesh, device_list)
        spec = train_step.abstract_step(self.plan.configs.model, self.plan.configs.train, mesh)
        in_tree = jax.tree.structure(((spec.state, spec.batch), {}))
        with jax.set_mesh(mesh):
            out_shapes = jax.eval_shape(train_step.make_train_step(spec.model, spec.train), spec.state, spec.batch)
        out_tree = jax.tree.structure(out_shapes)
        if str(in_tree) != self.in_tree or str(out_tree) != self.out_tree:
            raise ArtifactError(
                f"{self.directory}: the train state's structure differs from the one compiled (flax or optax "
                "changed?); compile again with this installation"
            )
        compiled = peak.load_executable(self.payload, in_tree, out_tree, backend=device_list[0].client,
                                        execution_devices=device_list)
        return spec, compiled

    def user_step(self, device_list=None):
        """(the user's Step, made again by its factory over `device_list`, the loaded executable, the jax Mesh)."""
        import jax

        from maxperf.aot import peak, targets, user_step

        device_list = list(device_list) if device_list is not None else jax.devices()
        mesh = targets.jax_mesh(self.user.topology, self.user.mesh, device_list)
        step = user_step.make_step(self.user.step, mesh, self.user.args)
        in_tree = jax.tree.structure((tuple(step.args), {}))
        options = {"donate_argnums": step.donate}
        if step.out_shardings is not None:
            options["out_shardings"] = step.out_shardings
        with user_step.context(step, mesh):
            out_tree = jax.tree.structure(jax.eval_shape(jax.jit(step.fn, **options), *step.args))
        if str(in_tree) != self.in_tree or str(out_tree) != self.out_tree:
            raise ArtifactError(f"{self.directory}: --step {self.user.step} now makes arguments or results of another "
                                "structure than the ones compiled (its code or its libraries changed?); compile again")
        compiled = peak.load_executable(self.payload, in_tree, out_tree, backend=device_list[0].client,
                                        execution_devices=device_list)
        return step, compiled, mesh


def load(path: str | os.PathLike) -> Artifact:
    """Reads `DIR` or `DIR/compiled.pkl`; refuses altered, truncated or crafted files and other library versions."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    if not directory.exists() or (path != directory and not path.exists()):
        raise ArtifactError(f"{path} does not exist; give a `maxperf compile` output directory or its compiled.pkl")
    manifest = artifacts.read_manifest(directory)
    if not manifest.get("compiled"):
        raise ArtifactError(f"{directory} holds no executable: its step did not compile (see memory.json)")
    artifacts.verify_hashes(directory, manifest)
    _check_versions(directory, manifest)
    blob = artifacts.read_plain_pickle((directory / "compiled.pkl").read_bytes())
    if not isinstance(blob, dict) or blob.get("schema") != artifacts.COMPILED_SCHEMA:
        raise ArtifactError(f"{directory}/compiled.pkl is not a {artifacts.COMPILED_SCHEMA} artifact")
    payload = blob.get("executable")
    if not isinstance(payload, bytes):
        raise ArtifactError(f"{directory}/compiled.pkl holds no executable")
    artifacts.check_executable_pickle(payload)
    user = user_request_from_manifest(manifest)
    return Artifact(directory, manifest, None if user is not None else plan_from_manifest(manifest), payload,
                    blob.get("in_tree", ""), blob.get("out_tree", ""), user)


def user_request_from_manifest(manifest: dict[str, Any]) -> UserRequest | None:
    """The user's step a manifest records (`step`), or None for maxperf's own step."""
    step = manifest.get("step")
    if not isinstance(step, dict) or step.get("kind") != "user":
        return None
    try:
        topo = manifest["topology"]
        topology = topologies.get(topo["name"], num_slices=topo.get("num_slices", 1),
                                  target_config_path=topo.get("target_config_path"))
        mesh = manifest["mesh"]
        args = step["args"]
        if not isinstance(args, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in args.items()):
            raise ValueError("the step's args are not text")
        return UserRequest(topology, StepName(module=str(step["module"]), factory=str(step["function"])),
                           from_dict(ParallelismConfig, manifest["parallelism"]),
                           Mesh(ici=mesh["ici"], dcn=mesh["dcn"]), dict(args))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(f"manifest.json does not describe a user's step this maxperf reads ({type(e).__name__}: "
                            f"{str(e)[:200]}); compile again with this installation") from None


def _check_versions(directory: Path, manifest: dict) -> None:
    have = library_versions()
    wrote = manifest.get("versions", {})
    platform = manifest.get("topology", {}).get("platform", "")
    differ = [f"{name} {wrote.get(name)} (here {have.get(name)})" for name in versions_that_must_match(platform)
              if wrote.get(name) != have.get(name)]
    if differ:
        raise ArtifactError(f"{directory} was compiled with other library versions: {', '.join(differ)}; an "
                            "executable loads only with the versions that compiled it")


def plan_from_manifest(manifest: dict[str, Any]) -> Request:
    """The plan a manifest records; a field that is missing or of the wrong form is an ArtifactError."""
    try:
        return _plan_from_manifest(manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ArtifactError(f"manifest.json does not describe a plan this maxperf reads ({type(e).__name__}: "
                            f"{str(e)[:200]}); compile again with this installation") from None


def _plan_from_manifest(manifest: dict[str, Any]) -> Request:
    topo = manifest["topology"]
    topology = topologies.get(topo["name"], num_slices=topo.get("num_slices", 1),
                              target_config_path=topo.get("target_config_path"))
    configs = Configs(model=from_dict(ModelConfig, manifest["model"]), train=from_dict(TrainConfig, manifest["train"]),
                      parallelism=from_dict(ParallelismConfig, manifest["parallelism"]))
    mesh = manifest["mesh"]
    return Request(topology, configs, Mesh(ici=mesh["ici"], dcn=mesh["dcn"]))
