"""What the server tells about itself: logs, statistics, metrics, its entry for ``aserve ps``.

Layer ``obs``, beside ``codecs`` and ``sched``: it imports only ``errors``,
``types`` and ``config``, and everything above may use it. stats.py (per-model
statistics the batchers keep, loop only), metrics.py (Prometheus families
built at scrape time; the NVML sampler thread), logs.py (text or JSON lines,
the access log), handler_metrics.py (handlers' own metrics, bounded labels),
log_throttle.py (one line per interval for junk from clients), fd_limit.py
(the open-file limit, raised at start and read by the connection bounds),
runtime_dir.py and registration.py (the running servers' entries).
"""
