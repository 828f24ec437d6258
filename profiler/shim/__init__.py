"""traindx's in-job shim: this folder goes first on the job's PYTHONPATH (profiler/launcher.py), so
that Python imports its sitecustomize.py at start-up and, from there, the _traindx_shim package
(standard library only: it cannot import traindx). As traindx.profiler.shim it is part of the
record layer and of the import contract; in the job, this file is never imported (the folder is a
path entry there, not a package)."""
