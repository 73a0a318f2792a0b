<?php
// Regenerates the "php" outputs of php_json_encode.json from its "in" texts, with PHP's own
// json_decode/json_encode (default flags, as queue 5's Codec\Json uses them):
//   php tests/data/php_json_encode.php tests/data/php_json_encode.json
// Per row, "in" is a raw envelope; PHP decodes it as Broker\Redis::claim() does and writes:
//   "requeue": the envelope retryPayload() builds (pid, queue, timestamp 1700000000,
//              payload, attempts + 1, then key when set), with the pid kept;
//   "publish": the envelope publish() builds from the decoded payload (pid, queue,
//              timestamp 1700000000, payload).
// Each is the bytes json_encode wrote, or {"error": message} where PHP threw.
$path = $argv[1];
$table = json_decode(file_get_contents($path), true, 512, JSON_THROW_ON_ERROR);
function attempt(callable $f): mixed {
    try {
        return $f();
    } catch (\Throwable $e) {
        return ['error' => get_class($e) . ': ' . $e->getMessage()];
    }
}
foreach ($table['rows'] as &$row) {
    $decoded = attempt(fn () => json_decode($row['in'], true, flags: JSON_THROW_ON_ERROR));
    if (!is_array($decoded) || isset($decoded['error'])) {
        $row['php'] = ['decode' => $decoded['error'] ?? 'not an array'];
        continue;
    }
    $payload = $decoded['payload'] ?? [];
    $retry = ['pid' => $decoded['pid'], 'queue' => $decoded['queue'], 'timestamp' => 1700000000,
        'payload' => $payload, 'attempts' => (int) ($decoded['attempts'] ?? 0) + 1];
    if (isset($decoded['key'])) {
        $retry['key'] = $decoded['key'];
    }
    $publish = ['pid' => $decoded['pid'], 'queue' => $decoded['queue'],
        'timestamp' => 1700000000, 'payload' => $payload];
    $row['php'] = [
        'requeue' => attempt(fn () => json_encode($retry, JSON_THROW_ON_ERROR)),
        'publish' => attempt(fn () => json_encode($publish, JSON_THROW_ON_ERROR)),
    ];
}
unset($row);
$table['produced_by'] = 'PHP ' . PHP_VERSION . ' (serialize_precision '
    . ini_get('serialize_precision') . '), tests/data/php_json_encode.php';
file_put_contents($path, json_encode($table, JSON_PRETTY_PRINT | JSON_UNESCAPED_SLASHES
    | JSON_UNESCAPED_UNICODE | JSON_THROW_ON_ERROR) . "\n");
