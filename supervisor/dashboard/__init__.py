"""``python -m supervisor dashboard JOB.toml ...``: a live web page of queues, supervisors and
failed jobs (issue 27).

One process reads each job's broker (and, where the job file names one, the supervisor's
metrics endpoint) on its own schedule; supervisors do no work for it. ``sources`` reads a
broker, ``history`` keeps what the sampler saw over the last hour, ``plots`` draws it as SVG,
``actions`` holds the operator actions, ``auth`` the secret, sessions, CSRF and one-time
action tokens, ``pids`` which pids a page may name, ``app`` the pages (Starlette, Jinja2
with autoescape) and ``cli`` the command line.
"""
