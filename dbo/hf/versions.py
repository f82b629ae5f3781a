"""The `transformers` releases dbo's generation support is tested on, kept at run time.

`dbo.hf` splits `transformers`' KV caches by reaching into their layer classes (their
attributes, lazy initializations and update methods: `docs/architecture.md` lists them),
and those change between releases. A release is tested when `make test` and the families
survey (`benchmarks/hf_families.py`: generation with both cache kinds, training, sharded)
pass on it; `make upgrade-pins` widens the range after they do. Outside it,
`overlap_generation` and the cache split rule raise `UntestedVersionError`;
`DBO_ALLOW_UNTESTED_VERSIONS=1` in the environment runs anyway, with one warning per
process. `python -m dbo.hf.check --family NAME` checks one model family on the installed
release first (tokens, logits and gradients with and without DBO).
"""

from __future__ import annotations

import os
import re
import warnings

TESTED_TRANSFORMERS = ("5.24", "5.25")
"""The first and last `transformers` minor releases tested (each with its patch releases);
pyproject.toml's `hf` extra declares the same range."""

ALLOW_UNTESTED = "DBO_ALLOW_UNTESTED_VERSIONS"
"""The environment variable that lets dbo run on an untested release (set to 1)."""


class UntestedVersionError(RuntimeError):
    """A library dbo reaches into is at a release dbo was not tested on. The message
    names the installed release, the tested range and the way on."""


def _minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a final release ("5.25.0", "5.25"); None for a pre-release or
    development build ("5.26.0.dev0", "5.26.0rc1"), which no check has seen."""
    found = re.fullmatch(r"(\d+)\.(\d+)(\.\d+)*(\.post\d+)?", version)
    return (int(found[1]), int(found[2])) if found else None


def pip_spec() -> str:
    """`TESTED_TRANSFORMERS` as pip writes it: ">=5.24,<5.26"."""
    low, high = TESTED_TRANSFORMERS
    major, minor = high.split(".")
    return f">={low},<{major}.{int(minor) + 1}"


def is_tested(version: str) -> bool:
    """Whether `transformers` `version` is in `TESTED_TRANSFORMERS`."""
    low, high = (_minor(bound) for bound in TESTED_TRANSFORMERS)
    minor = _minor(version)
    return minor is not None and low is not None and high is not None and low <= minor <= high


_checked: set[str] = set()
"""The releases `check_transformers` let through in this process (tested, or warned of)."""


def check_transformers(version: str | None = None) -> None:
    """Raise `UntestedVersionError` unless `transformers` (`version`, else the installed
    one) is a tested release or `DBO_ALLOW_UNTESTED_VERSIONS=1`; in that case warn once
    per process and release. Cheap after the first call."""
    if version is None:
        import transformers

        version = transformers.__version__
    if version in _checked:
        return
    if is_tested(version):
        _checked.add(version)
        return
    low, high = TESTED_TRANSFORMERS
    tested = f"{low}.x to {high}.x"
    if os.environ.get(ALLOW_UNTESTED) == "1":
        _checked.add(version)
        warnings.warn(
            f"dbo.hf runs on transformers {version}, outside its tested releases ({tested}), "
            f"because {ALLOW_UNTESTED}=1: check your model family with "
            "`python -m dbo.hf.check --family <model_type>`",
            RuntimeWarning, stacklevel=3,
        )
        return
    raise UntestedVersionError(
        f"dbo.hf is tested on transformers {tested}, and transformers {version} is "
        f"installed: its cache classes may differ from what dbo splits. Install a tested "
        f"release (pip install 'transformers{pip_spec()}'), or check your model family with "
        f"`python -m dbo.hf.check --family <model_type>` and set {ALLOW_UNTESTED}=1 to "
        "run anyway"
    )
