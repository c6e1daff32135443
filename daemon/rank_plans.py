"""store.plan: the layout plan of a host's rank stores, from a plan file or a built-in plan for
the model the board's config.json names, checked where it enters (``PlanRefused``: one line).
"""

from __future__ import annotations

from patchswarm.daemon.checkpoint import FILES_KEY, MAX_SMALL_FILES_BYTES, CheckpointError
from patchswarm.daemon.checkpoint_writer import checkpoint_files
from patchswarm.daemon.store_format import StoreError
from patchswarm.protocol.errors import PlanError
from patchswarm.protocol.files import InputFileError, read_file
from patchswarm.protocol.layout_builtin import builtin_plan
from patchswarm.protocol.layout_file import MAX_FILE_BYTES, PlanFile, parse_plan_file
from patchswarm.protocol.layout_plan import LayoutPlan
from patchswarm.protocol.served import TensorSpec
from patchswarm.protocol.untrusted_json import UntrustedJSONError, load_json

__all__ = ["PlanRefused", "read_plan_file", "resolve_plan"]


class PlanRefused(StoreError):
    """The layout plan does not fit the model (or store.ranks); nothing was written."""


def read_plan_file(path: str) -> PlanFile:
    """store.plan as a plan file: read (bounded) and parsed at start-up; PlanRefused (one line) otherwise."""
    try:
        data = read_file(path, MAX_FILE_BYTES)
    except InputFileError as e:
        raise PlanRefused(f"store.plan: cannot read the plan file {path}: {e.reason}") from None
    try:
        return parse_plan_file(data)
    except PlanError as e:
        raise PlanRefused(f"store.plan: {path}: {e}") from None


def resolve_plan(
    setting: str, ranks: int, canonical: list[TensorSpec], metadata: dict[str, str], plan_file: PlanFile | None = None
) -> LayoutPlan:
    """store.plan as a checked LayoutPlan for this model: a plan file's rules, or a built-in plan (auto: the
    family config.json names; or a family name) from the board's config.json (manifest metadata
    ``checkpoint.files``).  PlanRefused: one line."""
    if plan_file is not None:
        try:
            return plan_file.expand(canonical, ranks)
        except (PlanError, ValueError) as e:
            raise PlanRefused(f"store.plan: {setting}: {e}") from None
    try:  # the board's words: parsed strictly and bounded, as pull --to and export.dir parse them
        files = checkpoint_files({k: v for k, v in metadata.items() if k == FILES_KEY})
        config = (
            load_json(files["config.json"], max_bytes=MAX_SMALL_FILES_BYTES, allow_nan=True)
            if "config.json" in files
            else None
        )
    except (CheckpointError, UntrustedJSONError) as e:
        raise PlanRefused(f"store.plan: the board's config.json (checkpoint.files) is unreadable: {e}") from None
    if not isinstance(config, dict):
        raise PlanRefused(
            f"store.plan: {setting!r} needs the model's config.json, which this run's manifests do not carry "
            "(publish from a Hugging Face checkpoint directory)"
        )
    if setting != "auto":
        config = {**config, "model_type": setting}
    try:
        return builtin_plan(config, canonical, ranks)
    except (PlanError, ValueError) as e:
        raise PlanRefused(f"store.plan: {e}") from None
