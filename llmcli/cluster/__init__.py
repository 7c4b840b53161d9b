"""Work spread over more than one machine: `run --batch --ray` on a Ray cluster (llmcli/cluster/ray_batch.py). Ray is
the `ray` extra, imported only here and only on `--ray`."""
