"""Errors that maxperf reports to the user as one line, with exit code 2 (bad input) or 3 (does not fit)."""

import difflib
from collections.abc import Iterable


class MaxperfError(Exception):
    """Bad input: the message says what was wrong and what would be right. Exit code 2."""

    exit_code = 2


class DoesNotFit(MaxperfError):
    """The step compiled (or was estimated) but needs more memory than the device has. Exit code 3."""

    exit_code = 3


class Unserializable(MaxperfError):
    """The step compiled, and its memory and optimized HLO are written, but jax cannot pickle its executable: no
    compiled.pkl, so it cannot run. Exit code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that the same cleanup runs. Exit code 143."""

    def __init__(self, *args):
        super().__init__(*args)
        _SIGTERM_SEEN.append(True)


# Every Terminated raised in this process: a library between the handler and the catch (Ray's waits) may turn it
# into a plain KeyboardInterrupt, which `was_terminated` still tells from Ctrl-C
_SIGTERM_SEEN: list[bool] = []


def was_terminated(e: BaseException) -> bool:
    """Whether the interruption `e` came from SIGTERM (Terminated, or an interruption raised after one was); the
    record is consumed, so that the next interruption is told apart afresh."""
    seen = isinstance(e, Terminated) or bool(_SIGTERM_SEEN)
    _SIGTERM_SEEN.clear()
    return seen


def require(ok: bool, message: str) -> None:
    """A MaxperfError with `message` unless `ok`: a config's checks, each one line naming what is valid."""
    if not ok:
        raise MaxperfError(message)


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The valid names nearest to `word`, best first, for 'did you mean' hints."""
    choices = list(choices)
    hits = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    if not hits:
        hits = [c for c in choices if word.lower() in c.lower() or c.lower() in word.lower()][:n]
    return hits


def unknown(kind: str, word: str, choices: Iterable[str]) -> MaxperfError:
    """An error for an unknown name that suggests the closest valid ones."""
    choices = list(choices)
    hits = closest(word, choices)
    shown = sorted(choices)
    catalog = {"model": "maxperf models", "topology": "maxperf topologies"}.get(kind)
    listing = ", ".join(shown[:12]) + (f" and {len(shown) - 12} more" if len(shown) > 12 else "") + (
        f" (`{catalog}` lists them)" if len(shown) > 12 and catalog else "")
    hint = f"did you mean {', '.join(hits)}?" if hits else f"valid: {listing}"
    return MaxperfError(f"unknown {kind} {word!r}; {hint}")
