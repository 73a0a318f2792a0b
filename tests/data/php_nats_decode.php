<?php
// Regenerates the "php" answers of php_nats_decode.json from its "in" texts:
//   php tests/data/php_nats_decode.php tests/data/php_nats_decode.json
// Each "in" is a raw message body; PHP goes through the steps of queue 5's Broker\Nats::pull()
// (N1, 17323b8): json_decode($raw, true, flags: JSON_THROW_ON_ERROR), is_array() and
// isset($data['pid'], $data['queue'], $data['timestamp']) -- no (int) cast, unlike
// Broker\Redis::claim() -- then new Message($data), here a class with Message's typed
// properties and constructor (no strict_types: PHP 8's coercive typing). "php" is null where
// a step throws or refuses, else [pid, queue, timestamp, payload, attempts] as PHP holds them.
// A deprecation or warning does not throw, so it does not refuse.
final class Message
{
    public string $pid;
    public string $queue;
    public int $timestamp;
    public array $payload;
    public int $attempts = 0;
    public ?int $sequence = null;

    public function __construct(array $array)
    {
        $this->pid = $array['pid'];
        $this->queue = $array['queue'];
        $this->timestamp = $array['timestamp'];
        $this->payload = $array['payload'] ?? [];
        $this->attempts = $array['attempts'] ?? 0;
        $this->sequence = $array['sequence'] ?? null;
    }
}
set_error_handler(fn () => true, E_DEPRECATED | E_WARNING | E_NOTICE);
$path = $argv[1];
$table = json_decode(file_get_contents($path), true, 512, JSON_THROW_ON_ERROR);
foreach ($table['rows'] as &$row) {
    try {
        $data = json_decode($row['in'], true, flags: JSON_THROW_ON_ERROR);
        if (!is_array($data) || !isset($data['pid'], $data['queue'], $data['timestamp'])) {
            throw new UnexpectedValueException('not an envelope');
        }
        $m = new Message($data);
        $row['php'] = [$m->pid, $m->queue, $m->timestamp, $m->payload, $m->attempts];
    } catch (\Throwable $e) {
        $row['php'] = null;
    }
}
unset($row);
$table['produced_by'] = 'PHP ' . PHP_VERSION . ', tests/data/php_nats_decode.php';
file_put_contents($path, json_encode($table, JSON_PRETTY_PRINT | JSON_UNESCAPED_SLASHES
    | JSON_THROW_ON_ERROR) . "\n");
