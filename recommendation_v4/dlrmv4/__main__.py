import logging
import os
import sys

from dlrmv4.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # One of several processes: leave without the interpreter's teardown, in which torch's autograd
    # and gloo threads can hang or abort the process after the run has ended (pytorch/pytorch#190489;
    # seen here about once in ten two-process runs). Everything the run writes is closed by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
