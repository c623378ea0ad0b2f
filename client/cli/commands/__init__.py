"""The CLI's commands, one module per group (jobs, scheduling, simulate, cluster, exec, autoscaler, cache, image,
metrics, tensorboard, admin, storage, at); client/cli/__init__.py adds each group to the app.

A command module holds typer commands and what only they use; what several share is in the package above:
parameters and checks (`params`), how a command reaches the services (`runner`), what is shown (`render`)
and how it is written (`output`).
"""
