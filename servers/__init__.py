"""servers: the server processes moetrace starts and stops.

- ``command``: a server command as moetrace reads it (its TP size and model flags,
  which SGLang it starts, the flags that keep hooks firing) and the command with
  moetrace's ``--forward-hooks`` entry added;
- ``process_group``: the server's process group (its own session, signalled whole,
  killed after a grace period) and who listens on a port;
- ``launcher``: ``moetrace launch``, one launch from ``_run.json`` to the summary line.

Above hooks (a launch hands the hooks their spec), below jobs (``audit --launch``).
"""
