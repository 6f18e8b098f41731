"""Training entry point: `python -m jaxrl_agentic.train --config configs/<recipe>.py`."""

import sys


def main(argv=None) -> int:
    # The pipeline loop lands with the training-program issue; until then say so plainly
    # instead of failing with a traceback.
    print(
        "jaxrl_agentic.train: the training loop is not available yet in this version; "
        "the models, sampler and environments can be used from Python (see README).",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
