"""Launching runs: the resource planner (``plan``), NeMo-Run launchers (``nemo_run``) and the
launcher environment they need (``launch_env``)."""
