<?php
// Regenerates the "php" answers of php_redis_decode.json from its "in" texts:
//   php tests/data/php_redis_decode.php tests/data/php_redis_decode.json
// Each "in" (or "in_hex", the bytes in hex where they are not UTF-8) is a raw envelope; PHP
// goes through the steps of queue 5's Broker\Redis::claim(): json_decode($raw, true,
// flags: JSON_THROW_ON_ERROR), is_array() and isset($e['pid'], $e['queue'], $e['timestamp']),
// $e['timestamp'] = (int) $e['timestamp'], then new Message($e), here a class with Message's
// typed properties and constructor (no strict_types: PHP 8's coercive typing). "php" is null
// where a step throws or refuses, else [pid, queue, timestamp, payload, attempts] as the
// Message holds them, then $e['key'] as json_decode left it when the envelope has a "key"
// field (Message has no key; retryPayload() writes it back from the decoded array).
// A deprecation or warning (a float with a fraction to int) does not throw, so it does not
// refuse.
//
// The answers are written as tests/test_envelope.py compares them with envelope.decode():
// PHP's array cannot tell {"0":1} from [1] nor {} from [], so payload and key keep the shape
// their JSON had (taken from json_decode($raw) without $associative, same values), and an
// empty payload is {}; a float keeps its fraction (1.0, -0.0) and INF is 1e999 (JSON has no
// INF: 1e999 reads back as INF in PHP and as inf in Python). One row a line.
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

const FLAGS = JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE | JSON_THROW_ON_ERROR;

/** What PHP made of $raw, as described above, or null where it refuses it. */
function claim(string $raw): ?array
{
    try {
        $e = json_decode($raw, true, flags: JSON_THROW_ON_ERROR);
        if (!is_array($e) || !isset($e['pid'], $e['queue'], $e['timestamp'])) {
            return null;
        }
        $e['timestamp'] = (int) $e['timestamp'];
        $m = new Message($e);
    } catch (\Throwable $error) {
        return null;
    }
    try {
        $shaped = json_decode($raw, false, flags: JSON_THROW_ON_ERROR);
    } catch (\JsonException $error) {
        // A property name PHP's objects refuse ("\u0000..."): keep the arrays, a list as [].
        $shaped = (object) $e;
    }
    $answer = [$m->pid, $m->queue, $m->timestamp,
        $m->payload === [] ? new stdClass() : $shaped->payload, $m->attempts];
    if (array_key_exists('key', $e)) {
        $answer[] = $shaped->key;
    }
    return $answer;
}

/** $v as JSON text: objects as objects, floats with their fraction, INF as 1e999. */
function json_text(mixed $v): string
{
    if ($v instanceof stdClass || (is_array($v) && !array_is_list($v))) {
        $members = [];
        foreach ((array) $v as $name => $member) {
            $members[] = json_encode((string) $name, FLAGS) . ':' . json_text($member);
        }
        return '{' . implode(',', $members) . '}';
    }
    if (is_array($v)) {
        return '[' . implode(',', array_map('json_text', $v)) . ']';
    }
    if (is_float($v) && is_infinite($v)) {
        return $v > 0 ? '1e999' : '-1e999';
    }
    return json_encode($v, FLAGS | JSON_PRESERVE_ZERO_FRACTION);
}

set_error_handler(fn () => true, E_DEPRECATED | E_WARNING | E_NOTICE);
$path = $argv[1];
$table = json_decode(file_get_contents($path), true, 512, JSON_THROW_ON_ERROR);
$rows = [];
foreach ($table['rows'] as $row) {
    $in = isset($row['in_hex']) ? '"in_hex": ' . json_encode($row['in_hex'], FLAGS)
        : '"in": ' . json_encode($row['in'], FLAGS);
    $raw = isset($row['in_hex']) ? hex2bin($row['in_hex']) : $row['in'];
    $rows[] = '        {' . $in . ', "php": ' . json_text(claim($raw)) . '}';
}
$producedBy = 'PHP ' . PHP_VERSION . ' (precision ' . ini_get('precision')
    . '), tests/data/php_redis_decode.php';
file_put_contents($path, "{\n    \"about\": " . json_encode($table['about'], FLAGS)
    . ",\n    \"rows\": [\n" . implode(",\n", $rows) . "\n    ],\n    \"produced_by\": "
    . json_encode($producedBy, FLAGS) . "\n}\n");
