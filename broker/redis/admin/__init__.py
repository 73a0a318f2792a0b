"""What the operator commands and the dashboard read and write of a Redis queue, beside the
broker: its failed, dead and poison lists (``lists``), retry (``retry``), the queue's state
(``status``) and what the dashboard browses (``browse``). Each takes the connected broker's
client, scripts and key names, never the job's configuration."""
