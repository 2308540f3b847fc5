"""vLLM's executors on SUPA. Only Ray needs anything: see ``ray_worker``
(imported only where vLLM's Ray executor runs, since it imports Ray)."""
