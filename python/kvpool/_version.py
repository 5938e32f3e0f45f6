"""kvpool's version (a bottom layer: imports nothing), read by ``kvpool.__version__``
and by the modules below the package's ``__init__`` that name it in messages."""

__version__ = "0.1.0"
