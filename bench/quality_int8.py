"""`moetier quality` with the experts' reference path rounding activations to int8 words (the
twin of the decode kernel's int8 mode, moe_ref.moe_slots_ref(act_int8=True)) or not.

  python bench/quality_int8.py int8|float STORE --reference HF_DIR --text TEXT
"""

from __future__ import annotations

import functools
import sys

from moetier.kernels import moe_ops, moe_ref


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("int8", "float"):
        raise SystemExit(__doc__)
    if sys.argv.pop(1) == "int8":
        moe_ops.moe_slots_ref = functools.partial(moe_ref.moe_slots_ref, act_int8=True)  # type: ignore[assignment]
    from moetier.cli.main import main as cli

    raise SystemExit(cli(["quality", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
