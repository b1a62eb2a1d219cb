"""HTTP frontend processes (``http.workers``; frontends layer).

With ``http.workers: N`` the core (the process whose loop owns the models and
every request's future) binds the public port and starts N frontend
processes: each accepts on that listening socket with aiohttp on a loop of
its own and forwards every request to the core's app, which listens on a
private Unix socket. The core's side: :mod:`.listeners` (the sockets and the
private folder) and :mod:`.pool` (spawn, restart, drain); the frontend's:
:mod:`.main` (the process), :mod:`.frontend` (its app's lifecycle) and
:mod:`.proxy` (forwarding); what crosses between them: :mod:`.wire`.
"""
