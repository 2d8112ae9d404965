// SPDX-License-Identifier: Apache-2.0
// The chat page (server/web/index.html) in a real browser, against a running
// server (specula's, or mock_server.mjs):
//   node chat_page_test.mjs http://127.0.0.1:8080 [--chromium=PATH] [--message=TEXT]
//                           [--allow-unstreamed]
// It loads "/", sends a message with #input + #send, checks the request the
// page makes (stream, include_usage, the messages), waits for the reply to
// stream into the last ".msg.assistant" (some text must show, in at least one
// rendered frame, before its stats do, unless --allow-unstreamed) and for its ".stats[data-tau]", then sends a
// second message with Enter and checks that the whole conversation went out.
// Exit codes: 0 pass, 1 fail, 2 usage, 77 skip (no chromium or playwright-core).
// Chromium: --chromium=PATH, else $CHROMIUM_PATH, else /usr/bin/chromium
// (Debian's package: apt-get install chromium). playwright-core: npm install
// in this folder.
import { existsSync } from "node:fs";

const SKIP = 77;
const args = process.argv.slice(2);
const option = (name) => {
  const a = args.find((x) => x.startsWith(`--${name}=`));
  return a === undefined ? undefined : a.slice(name.length + 3);
};
const flag = (name) => args.includes(`--${name}`);
const base = args.find((x) => !x.startsWith("--")) ?? process.env.SPECULA_URL;
if (!base) {
  console.error("usage: node chat_page_test.mjs BASE_URL [--chromium=PATH] [--message=TEXT] " +
                "[--allow-unstreamed]");
  process.exit(2);
}
const chromiumPath = option("chromium") ?? process.env.CHROMIUM_PATH ?? "/usr/bin/chromium";
const message = option("message") ?? "Count from 1 to 20, separated by spaces.";
const followUp = "Now count back down to 1.";
const replyTimeoutMs = 60_000;

if (!existsSync(chromiumPath)) {
  console.log(`SKIP: chromium is not installed (apt-get install chromium); looked for ${chromiumPath}`);
  process.exit(SKIP);
}
let chromium;
try {
  ({ chromium } = await import("playwright-core"));
} catch (e) {
  console.log("SKIP: playwright-core is not installed (cd tests/server/node && npm install)");
  process.exit(SKIP);
}

function fail(why) {
  console.error(`FAIL: chat page at ${base}: ${why}`);
  process.exitCode = 1;
  throw new Error(why);
}

const browser = await chromium.launch({ executablePath: chromiumPath, headless: true,
                                        args: ["--no-sandbox"] });
const started = Date.now();
try {
  const page = await browser.newPage();
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(e.message));
  const requests = [];
  page.on("request", (r) => {
    if (r.method() === "POST" && new URL(r.url()).pathname === "/v1/chat/completions") {
      try { requests.push(JSON.parse(r.postData() ?? "")); } catch { requests.push(null); }
    }
  });

  const response = await page.goto(new URL("/", base).href, { timeout: 30_000 });
  if (!response || !response.ok()) fail(`GET / answered ${response ? response.status() : "nothing"}`);
  if ((await page.title()) !== "specula") fail(`the title is "${await page.title()}", not "specula"`);
  for (const id of ["#input", "#send", "#messages", "#model"]) {
    if ((await page.locator(id).count()) !== 1) fail(`no element ${id}`);
  }

  // Short replies keep the test quick on a CPU server (the setting may sit in
  // a collapsed panel, so set it the way an input event would).
  await page.evaluate(() => {
    const el = document.getElementById("max-tokens");
    if (!el) return;
    el.value = "48";
    el.dispatchEvent(new Event("input", { bubbles: true }));
    el.dispatchEvent(new Event("change", { bubbles: true }));
  });

  // One turn: type, send, watch the last reply stream in, wait for its stats.
  async function turn(text, useEnter) {
    const before = await page.locator(".msg.assistant").count();
    await page.fill("#input", text);
    // Count the animation frames in which the newest reply shows text but no
    // stats yet: states in the middle of the stream that a user would see.
    await page.evaluate((n) => {
      window.__partial = 0;
      const token = (window.__sampler = {});
      const sample = () => {
        if (window.__sampler !== token) return;
        const replies = document.querySelectorAll(".msg.assistant");
        if (replies.length > n) {
          const last = replies[replies.length - 1];
          const content = last.querySelector(".content") ?? last;
          if (last.querySelector(".stats")) return;  // finished: stop sampling
          if (content.textContent.trim() !== "") ++window.__partial;
        }
        requestAnimationFrame(sample);
      };
      requestAnimationFrame(sample);
    }, before);
    if (useEnter) await page.press("#input", "Enter");
    else await page.click("#send");

    const last = page.locator(".msg.assistant").nth(before);
    const outcome = await Promise.race([
      last.locator(".stats[data-tau]").waitFor({ timeout: replyTimeoutMs }).then(() => "stats"),
      page.locator(".msg.error").first().waitFor({ timeout: replyTimeoutMs }).then(() => "error"),
    ]).catch(() => "timeout");
    if (outcome === "error") fail(`the page shows an error: ${await page.locator(".msg.error").first().textContent()}`);
    if (outcome === "timeout") {
      fail(`no finished reply (.msg.assistant .stats[data-tau]) within ${replyTimeoutMs / 1000} s`);
    }
    const reply = (await last.locator(".content").textContent()) ?? "";
    if (reply.trim() === "") fail("the reply is empty");
    const partial = await page.evaluate(() => window.__partial);
    if (partial === 0 && !flag("allow-unstreamed")) {
      fail("the reply never showed text before its stats (not streamed?); --allow-unstreamed allows that");
    }
    const stats = last.locator(".stats");
    const tau = await stats.getAttribute("data-tau");
    const acceptance = await stats.getAttribute("data-acceptance");
    if (tau !== "" && !Number.isFinite(Number(tau))) fail(`data-tau is "${tau}", not a number`);
    if (acceptance !== "" && acceptance !== null && !Number.isFinite(Number(acceptance))) {
      fail(`data-acceptance is "${acceptance}", not a number`);
    }
    const statsText = await stats.evaluate((el) =>
      Array.from(el.children, (c) => c.textContent.trim()).filter(Boolean).join(" | "));
    return { reply, partial, tau, acceptance, statsText };
  }

  const first = await turn(message, false);
  const req1 = requests[0];
  if (!req1) fail("the page sent no POST /v1/chat/completions (or not JSON)");
  if (req1.stream !== true) fail("the request does not ask for stream: true");
  if (req1.stream_options?.include_usage !== true) fail("the request does not set stream_options.include_usage");
  const msgs1 = req1.messages ?? [];
  if (msgs1.at(-1)?.role !== "user" || msgs1.at(-1)?.content !== message) {
    fail(`the request's last message is not the typed one: ${JSON.stringify(msgs1.at(-1))}`);
  }

  const second = await turn(followUp, true);
  const req2 = requests[1];
  if (!req2) fail("Enter in #input sent no request");
  const turns = (req2.messages ?? []).filter((m) => m.role !== "system");
  const roles = turns.map((m) => m.role).join(",");
  if (roles !== "user,assistant,user" || turns[1].content !== first.reply || turns[2].content !== followUp) {
    fail(`the second request does not carry the conversation: roles ${roles}`);
  }
  if (pageErrors.length) fail(`JavaScript errors on the page: ${pageErrors.join("; ")}`);

  const model = ((await page.locator("#model").textContent()) ?? "").trim();
  const show = (t) => `${t.reply.length} chars, ${t.partial} frames mid-stream, tau ${t.tau || "-"}, ` +
                      `acceptance ${t.acceptance ? t.acceptance + "%" : "-"}`;
  console.log(`PASS: chat page at ${base} (model ${model || "?"}): turn 1 ${show(first)}; ` +
              `turn 2 (Enter) ${show(second)}; stats "${second.statsText}"; ` +
              `${((Date.now() - started) / 1000).toFixed(1)} s`);
} catch (e) {
  if (!process.exitCode) {
    console.error(`FAIL: chat page at ${base}: ${e.message}`);
    process.exitCode = 1;
  }
} finally {
  await browser.close();
}
