"""Test support shared by the ppo-* packages' test suites (their ``test`` dependency group).

- ``run_ranks``: start one Python process per rank of a torch.distributed group on this machine
  (real processes, a real TCP rendezvous on 127.0.0.1), wait for all of them within a timeout, and
  fail naming the rank and its output.
- ``free_port``: a TCP port free on 127.0.0.1.
- ``listening_addresses``: the ``(address, port)`` pairs a process listens on (Linux ``/proc``).
- ``skip_gpu_tests_without_cuda``: the ``pytest_collection_modifyitems`` hook that skips tests marked
  ``gpu`` when CUDA is not available; a package's ``conftest.py`` assigns it.
"""

from ppo_testsupport.gpu import skip_gpu_tests_without_cuda
from ppo_testsupport.ranks import RankFailure, free_port, run_ranks
from ppo_testsupport.sockets import listening_addresses

__version__ = "0.2.0"

__all__ = [
    "RankFailure",
    "__version__",
    "free_port",
    "listening_addresses",
    "run_ranks",
    "skip_gpu_tests_without_cuda",
]
