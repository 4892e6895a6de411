"""``--engine vllm``: one vLLM ``AsyncLLM`` behind the worker's ``Engine`` interface.

Only ``engine.py`` imports vLLM (the registry imports it when ``--engine vllm`` is chosen), so the
mocker path and the default venv, which has no vLLM, never pay for it. ``zmq_events.py`` (the KV
event wire decoder and its re-hashing index), ``amx.py`` and ``user_args.py`` (the
``--vllm-engine-args`` check the worker's settings run) import nothing from vLLM.
"""
