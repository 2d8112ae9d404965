// End-to-end tests of `specula serve` through the official `openai` client:
// the embedded default model (a tiny Gemma-4-shaped family with its drafter;
// its text is gibberish, but greedy decoding is deterministic).
// Run: SPECULA_BIN=build/apps/specula node --test tests/server/node/e2e_test.mjs
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { startServer, runSpecula, request, metrics } from './server_util.mjs';

let server;
let client;

before(async () => {
  server = await startServer();
  client = new OpenAI({ baseURL: `${server.baseURL}/v1`, apiKey: 'x', maxRetries: 0, timeout: 60_000 });
});

after(async () => {
  if (server) await server.stop();
});

const CHAT = [{ role: 'user', content: 'Write a function that adds two numbers.' }];
const PROMPT = 'def fibonacci(n):';

// Collects a streamed response: the chunks, the text per choice, the finish
// reasons, and the usage chunk.
async function collect(stream) {
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  const text = {};
  const finish = {};
  let usage;
  for (const c of chunks) {
    if (c.usage) usage = c.usage;
    for (const ch of c.choices ?? []) {
      const piece = ch.delta ? ch.delta.content : ch.text;
      if (piece) text[ch.index] = (text[ch.index] ?? '') + piece;
      if (ch.finish_reason) finish[ch.index] = ch.finish_reason;
    }
  }
  return { chunks, text, finish, usage };
}

const complete = (params) => client.completions.create({ model: 'specula-default', ...params });
const chat = (params) => client.chat.completions.create({ model: 'specula-default', ...params });

test('chat: non-streaming and streaming give the same greedy text', async () => {
  const r = await chat({ messages: CHAT, max_tokens: 16, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  const msg = r.choices[0].message;
  assert.equal(msg.role, 'assistant');
  assert.equal(typeof msg.content, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason), r.choices[0].finish_reason);
  assert.ok(r.usage.prompt_tokens > 0);
  assert.ok(r.usage.completion_tokens > 0 && r.usage.completion_tokens <= 16);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);

  const s = await collect(await chat({
    messages: CHAT, max_tokens: 16, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  }));
  const first = s.chunks[0];
  assert.equal(first.object, 'chat.completion.chunk');
  assert.equal(first.choices[0].delta.role, 'assistant');
  assert.equal(s.text[0] ?? '', msg.content);
  const withChoices = s.chunks.filter((c) => c.choices.length > 0);
  assert.equal(withChoices.at(-1).choices[0].finish_reason, r.choices[0].finish_reason);
  const last = s.chunks.at(-1);
  assert.deepEqual(last.choices, [], 'the usage chunk has no choices');
  assert.equal(last.usage.completion_tokens, r.usage.completion_tokens);
  assert.equal(last.usage.prompt_tokens, r.usage.prompt_tokens);
});

test('completions: non-streaming and streaming give the same greedy text', async () => {
  const r = await complete({ prompt: PROMPT, max_tokens: 20, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  assert.equal(typeof r.choices[0].text, 'string');
  assert.ok(r.choices[0].text.length > 0);
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  const s = await collect(await complete({
    prompt: PROMPT, max_tokens: 20, temperature: 0, stream: true, stream_options: { include_usage: true },
  }));
  assert.equal(s.text[0], r.choices[0].text);
  const withChoices = s.chunks.filter((c) => c.choices.length > 0);
  assert.equal(withChoices.at(-1).choices[0].finish_reason, r.choices[0].finish_reason);
  assert.deepEqual(s.chunks.at(-1).choices, []);
  assert.deepEqual(
    { p: s.usage.prompt_tokens, c: s.usage.completion_tokens },
    { p: r.usage.prompt_tokens, c: r.usage.completion_tokens });
  // Without include_usage: no usage chunk.
  const plain = await collect(await complete({ prompt: PROMPT, max_tokens: 20, temperature: 0, stream: true }));
  assert.equal(plain.text[0], r.choices[0].text);
  assert.ok(plain.chunks.every((c) => !c.usage), 'no usage without stream_options.include_usage');
});

test('stop strings: the output ends before the first occurrence, finish_reason stop', async (t) => {
  for (const endpoint of ['completions', 'chat']) {
    const call = (extra) => endpoint === 'chat'
      ? chat({ messages: CHAT, max_tokens: 32, temperature: 0, ...extra })
      : complete({ prompt: PROMPT, max_tokens: 32, temperature: 0, ...extra });
    const textOf = (r) => endpoint === 'chat' ? r.choices[0].message.content : r.choices[0].text;
    const full = textOf(await call({}));
    // A substring from the middle of the output (not at its start).
    assert.ok(full.length >= 8, `${endpoint}: greedy output too short to pick a stop string: ${JSON.stringify(full)}`);
    const stop = full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 3);
    const expected = full.slice(0, full.indexOf(stop));
    t.diagnostic(`${endpoint}: stop ${JSON.stringify(stop)} in ${JSON.stringify(full)}`);
    const r = await call({ stop: [stop] });
    assert.equal(textOf(r), expected, `${endpoint}: stop ${JSON.stringify(stop)} in ${JSON.stringify(full)}`);
    assert.equal(r.choices[0].finish_reason, 'stop');
    // Streaming stops at the same place.
    const s = await collect(await call({ stop: stop, stream: true }));
    assert.equal(s.text[0] ?? '', expected, `${endpoint} streaming, stop ${JSON.stringify(stop)}`);
    assert.equal(s.finish[0], 'stop');
  }
});

test('seeds reproduce sampled output', async () => {
  const sample = async (seed) => (await complete({ prompt: PROMPT, max_tokens: 24, temperature: 0.8, seed })).choices[0].text;
  const a = await sample(7);
  const b = await sample(7);
  assert.equal(a, b, 'the same seed gives the same text');
  const c = await sample(8);
  if (c === a) console.log('note: seeds 7 and 8 gave the same text (allowed, unlikely)');
  const chatSample = async (seed) => (await chat({ messages: CHAT, max_tokens: 16, temperature: 0.8, seed })).choices[0].message.content;
  assert.equal(await chatSample(7), await chatSample(7));
});

test('greedy completions equal `specula generate`', async () => {
  for (const prompt of [PROMPT, 'Hello world', 'import numpy as np\n']) {
    const { stdout } = await runSpecula(['generate', '--prompt', prompt, '-n', '24', '--temperature', '0', '--json']);
    const gen = JSON.parse(stdout);
    const r = await complete({ prompt, max_tokens: 24, temperature: 0 });
    assert.equal(r.choices[0].text, gen.text, `prompt ${JSON.stringify(prompt)}`);
    assert.equal(r.usage.completion_tokens, gen.stats.generated_tokens);
    assert.equal(r.usage.prompt_tokens, gen.stats.prompt_tokens);
  }
});

test('speculation on or off: the same greedy text; usage.speculative when on', async () => {
  for (const endpoint of ['completions', 'chat']) {
    const call = (extra) => endpoint === 'chat'
      ? chat({ messages: CHAT, max_tokens: 32, temperature: 0, ignore_eos: true, ...extra })
      : complete({ prompt: PROMPT, max_tokens: 32, temperature: 0, ...extra });
    const textOf = (r) => endpoint === 'chat' ? r.choices[0].message.content : r.choices[0].text;
    const def = await call({});
    const off = await call({ speculative: { enabled: false } });
    const k2 = await call({ speculative: { draft_tokens: 2 } });
    assert.equal(textOf(off), textOf(def), `${endpoint}: speculation off vs default`);
    assert.equal(textOf(k2), textOf(def), `${endpoint}: draft_tokens 2 vs default`);
    assert.equal(off.usage.completion_tokens, def.usage.completion_tokens);
    for (const [name, r] of [['default', def], ['draft_tokens 2', k2]]) {
      const sp = r.usage.speculative;
      assert.ok(sp, `${endpoint} ${name}: usage.speculative missing: ${JSON.stringify(r.usage)}`);
      assert.ok(sp.drafted > 0, `${endpoint} ${name}: drafted ${sp.drafted}`);
      assert.ok(sp.accepted >= 0 && sp.accepted <= sp.drafted);
    }
    assert.ok(k2.usage.speculative.accepted_by_position === undefined ||
      k2.usage.speculative.accepted_by_position.length <= 2, JSON.stringify(k2.usage.speculative));
    const offSp = off.usage.speculative;
    assert.ok(offSp === undefined || offSp === null || offSp.drafted === 0,
      `${endpoint}: speculation off but usage.speculative ${JSON.stringify(offSp)}`);
  }
});

test('concurrency: 8 requests at once give what each gives alone', async () => {
  const prompts = ['def add(a, b):', 'class Stack:', 'import os\n', 'for i in range(10):',
    '# A program that', 'x = [', 'def main():\n    ', 'while True:'];
  const reqs = prompts.map((p, i) => ({
    chat: i % 3 === 2,
    stream: i % 2 === 1,
    params: {
      max_tokens: 8 + 4 * i,
      temperature: i % 4 === 3 ? 0.9 : 0,
      ...(i % 4 === 3 ? { seed: 100 + i } : {}),
      ...(i % 3 === 2 ? { messages: [{ role: 'user', content: p }] } : { prompt: p }),
    },
  }));
  const run = async ({ chat: isChat, stream, params }) => {
    const f = isChat ? chat : complete;
    if (stream) {
      const s = await collect(await f({ ...params, stream: true }));
      return { text: s.text[0] ?? '', finish: s.finish[0] };
    }
    const r = await f(params);
    return { text: isChat ? r.choices[0].message.content : r.choices[0].text, finish: r.choices[0].finish_reason };
  };
  const alone = [];
  for (const r of reqs) alone.push(await run(r));
  const together = await Promise.all(reqs.map(run));
  for (let i = 0; i < reqs.length; ++i)
    assert.deepEqual(together[i], alone[i], `request ${i}: ${JSON.stringify(reqs[i])}`);
});

test('usage and /metrics agree', async () => {
  const counters = ['specula:generation_tokens_total', 'specula:prompt_tokens_total',
    'specula:spec_decode_num_draft_tokens_total', 'specula:spec_decode_num_accepted_tokens_total'];
  const perPos = (m) => Object.entries(m)
    .filter(([k]) => k.startsWith('specula:spec_decode_num_accepted_tokens_per_pos_total{'))
    .reduce((s, [, v]) => s + v, 0);
  const m0 = await metrics(server.port);
  for (const c of counters) assert.ok(c in m0, `GET /metrics has no ${c}`);

  const sum = { completion: 0, prompt: 0, drafted: 0, accepted: 0 };
  const add = (usage, n = 1) => {
    sum.completion += usage.completion_tokens;
    sum.prompt += usage.prompt_tokens * n;
    sum.drafted += usage.speculative?.drafted ?? 0;
    sum.accepted += usage.speculative?.accepted ?? 0;
  };
  add((await complete({ prompt: PROMPT, max_tokens: 24, temperature: 0 })).usage);
  add((await chat({ messages: CHAT, max_tokens: 12, temperature: 0.7, seed: 3 })).usage);
  add((await complete({ prompt: 'class A:', max_tokens: 10, temperature: 0, speculative: { enabled: false } })).usage);
  add((await complete({ prompt: 'x = 1\n', max_tokens: 12, temperature: 0.8, seed: 1, n: 2 })).usage, 2);
  add((await collect(await chat({ messages: CHAT, max_tokens: 10, temperature: 0, stream: true,
    stream_options: { include_usage: true } }))).usage);
  add((await collect(await complete({ prompt: PROMPT, max_tokens: 10, temperature: 0, stream: true,
    stream_options: { include_usage: true }, speculative: { draft_tokens: 2 } }))).usage);

  const m1 = await metrics(server.port);
  const d = (name) => m1[name] - m0[name];
  assert.deepEqual({
    completion: d('specula:generation_tokens_total'),
    prompt: d('specula:prompt_tokens_total'),
    drafted: d('specula:spec_decode_num_draft_tokens_total'),
    accepted: d('specula:spec_decode_num_accepted_tokens_total'),
  }, sum, 'metric deltas (left) against usage sums (right)');
  assert.ok(sum.drafted > 0);
  assert.equal(perPos(m1) - perPos(m0), d('specula:spec_decode_num_accepted_tokens_total'),
    'per-position accepted counters sum to the accepted counter');
});

test('n=2 returns two choices', async () => {
  const r = await complete({ prompt: PROMPT, max_tokens: 12, temperature: 0.9, seed: 11, n: 2 });
  assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
  for (const c of r.choices) assert.equal(typeof c.text, 'string');
  const rc = await chat({ messages: CHAT, max_tokens: 8, temperature: 0.9, seed: 11, n: 2 });
  assert.deepEqual(rc.choices.map((c) => c.index).sort(), [0, 1]);
  const s = await collect(await complete({ prompt: PROMPT, max_tokens: 12, temperature: 0.9, seed: 11, n: 2, stream: true }));
  assert.deepEqual(Object.keys(s.finish).sort(), ['0', '1']);
  // Streaming or not, the same seed gives the same choices.
  assert.deepEqual([s.text[0] ?? '', s.text[1] ?? ''], [r.choices.find((c) => c.index === 0).text, r.choices.find((c) => c.index === 1).text]);
});

test('logprobs: one entry per token with 3 alternatives', async () => {
  let r;
  try {
    r = await chat({ messages: CHAT, max_tokens: 8, temperature: 0, logprobs: true, top_logprobs: 3, ignore_eos: true });
  } catch (e) {
    assert.fail(`chat logprobs refused: ${e.status} ${e.message}`);
  }
  const content = r.choices[0].logprobs?.content;
  assert.ok(Array.isArray(content), `chat: no logprobs.content: ${JSON.stringify(r.choices[0])}`);
  assert.equal(content.length, r.usage.completion_tokens,
    `chat: logprobs requested, ${content.length} entries for ${r.usage.completion_tokens} tokens: ${JSON.stringify(r.choices[0].logprobs)}`);
  for (const e of content) {
    assert.equal(typeof e.token, 'string');
    assert.ok(e.logprob <= 0, JSON.stringify(e));
    assert.equal(e.top_logprobs.length, 3, JSON.stringify(e));
    // Greedy: the chosen token is the most likely one.
    assert.ok(e.top_logprobs[0].logprob <= e.logprob + 1e-4, JSON.stringify(e));
  }
  assert.equal(content.map((e) => e.token).join(''), r.choices[0].message.content);

  let rc;
  try {
    rc = await complete({ prompt: PROMPT, max_tokens: 8, temperature: 0, logprobs: 3 });
  } catch (e) {
    assert.fail(`completions logprobs refused: ${e.status} ${e.message}`);
  }
  const lp = rc.choices[0].logprobs;
  assert.ok(lp, `completions: no logprobs: ${JSON.stringify(rc.choices[0])}`);
  assert.equal(lp.tokens.length, rc.usage.completion_tokens,
    `completions: logprobs 3 requested, ${lp.tokens.length} tokens listed for ${rc.usage.completion_tokens}: ${JSON.stringify(lp)}`);
  assert.equal(lp.token_logprobs.length, lp.tokens.length);
  assert.equal(lp.top_logprobs.length, lp.tokens.length);
  for (const top of lp.top_logprobs) {
    // A dict token -> logprob: tokens with the same text collapse, so at most 3.
    const n = Object.keys(top).length;
    assert.ok(n >= 1 && n <= 3, JSON.stringify(top));
  }
  assert.ok(lp.top_logprobs.filter((t) => Object.keys(t).length === 3).length >= lp.tokens.length / 2,
    JSON.stringify(lp.top_logprobs));
  assert.equal(lp.tokens.join(''), rc.choices[0].text);

  // Streaming: the chunks' entries together are the non-streaming ones.
  const s = await collect(await chat({ messages: CHAT, max_tokens: 8, temperature: 0, logprobs: true,
    top_logprobs: 3, ignore_eos: true, stream: true }));
  const streamed = s.chunks.flatMap((c) => c.choices.flatMap((ch) => ch.logprobs?.content ?? []));
  assert.deepEqual(streamed.map((e) => e.token), content.map((e) => e.token));
  for (let i = 0; i < content.length; ++i)
    assert.ok(Math.abs(streamed[i].logprob - content[i].logprob) < 1e-5, `entry ${i}`);
});

test('GET /v1/models, /health, /', async () => {
  const models = await client.models.list();
  const ids = [];
  for await (const m of models) ids.push(m.id);
  assert.ok(ids.includes('specula-default'), JSON.stringify(ids));
  const health = await request(server.port, { path: '/health' });
  assert.equal(health.status, 200);
  const page = await request(server.port, { path: '/' });
  assert.equal(page.status, 200);
  assert.match(page.headers['content-type'], /^text\/html/);
  assert.match(page.body, /<html/i);
});
