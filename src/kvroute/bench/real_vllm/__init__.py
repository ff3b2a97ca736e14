"""kvroute in front of real vLLM CPU engines (docs/real-vllm.md).

The engines run from their own venv (``.venv-vllm``, made by ``scripts/real_vllm/setup.sh``,
which has vLLM but not kvroute); these modules run in kvroute's and start them:

- ``engines``: start, probe and stop ``vllm serve`` processes and read their counters;
- ``events``: follow an engine's KV events into the set of blocks it holds;
- ``workload``: the shared-prefix chat workload and its infinite-cache ceiling;
- ``routers``: start a ``kvroute serve`` per mode and read its view;
- ``results``: what one run found, the table and issue 10's verdict;
- ``e2e``: the end-to-end run (``scripts/real_vllm/e2e.py`` is its entry).

``scripts/real_vllm/make_model.py`` and ``vllm_serve.py`` stay scripts: they run under
the vLLM venv's Python.
"""
