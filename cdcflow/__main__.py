"""The ``cdcflow`` command (and ``python -m cdcflow``).

:func:`main` loads the command line (:mod:`cdcflow.cli`, which loads most of cdcflow)
itself, so that a Ctrl-C or SIGTERM while it loads ends the command the way it does
later, with one line and exit 130, not Python's traceback of the import under way.
"""

import signal
import sys

EXIT_INTERRUPTED = 130


def main() -> int:
    try:
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, signal.default_int_handler)
        from cdcflow.cli import main as command
    except KeyboardInterrupt:
        print("\ncdcflow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return command()


if __name__ == "__main__":
    sys.exit(main())
