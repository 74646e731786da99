from dlrmv4.cli import main
from dlrmv4.distributed import exit_process

exit_process(main())
