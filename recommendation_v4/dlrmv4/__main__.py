from dlrmv4.cli import main
from dlrmv4.train.distributed import exit_process

exit_process(main())
