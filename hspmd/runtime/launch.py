"""Where `find_mpiexec` and the rest of `hspmd.runtime.launcher.launch` were before the launcher had
its own folder; kept for scripts outside the project that import it from here."""
from hspmd.runtime.launcher.launch import *  # noqa: F401,F403
from hspmd.runtime.launcher.launch import __all__  # noqa: F401
