from dlrmv4.cli import main
from dlrmv4.distributed.liveness import exit_process

exit_process(main())
