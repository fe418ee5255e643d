"""One door per foreign internal: every private name of another library that tandem uses is in this package, one
module per library (python.py: CPython's standard library; torch.py; transformers.py; vllm.py), each with the
versions it was read on and a `check()` that names in one line what a new version moved. tests/test_compat.py
scans the repository for private names of other libraries and fails on one used anywhere else."""


def missing(owner, names: tuple[str, ...], where: str) -> list[str]:
    """`where.name` for each of `names` that `owner` lacks."""
    return [f"{where}.{name}" for name in names if not hasattr(owner, name)]
