// memra's chat page: streams /v1/chat/completions, renders markdown, shows reasoning and tokens/s.
// No dependencies, nothing fetched from the network but this server's API.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const log = $("log"), input = $("input"), sendBtn = $("send"), stopBtn = $("stop");
  const history = [];
  let controller = null;

  for (const id of ["model", "apikey", "temperature", "maxtokens"]) {
    const saved = localStorage.getItem("memra." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem("memra." + id, $(id).value));
  }

  function escapeHtml(s) {
    return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }

  function inline(s) {  // s is already HTML-escaped
    return s
      .replace(/`([^`]+)`/g, "<code>$1</code>")
      .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
      .replace(/\[([^\]]+)\]\((https?:\/\/[^)\s]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
  }

  // A small markdown subset: fenced code, headings, bullet/numbered lists, paragraphs, inline marks.
  function markdown(src) {
    const out = [];
    const parts = src.split(/```/);
    parts.forEach((part, i) => {
      if (i % 2 === 1) {
        const nl = part.indexOf("\n");
        const body = nl >= 0 ? part.slice(nl + 1) : part;
        out.push("<pre><code>" + escapeHtml(body) + "</code></pre>");
        return;
      }
      let list = null;
      const closeList = () => { if (list) { out.push("</" + list + ">"); list = null; } };
      for (const raw of part.split("\n")) {
        const line = escapeHtml(raw);
        let m;
        if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
          closeList();
          out.push("<h" + m[1].length + ">" + inline(m[2]) + "</h" + m[1].length + ">");
        } else if ((m = line.match(/^\s*[-*]\s+(.*)$/))) {
          if (list !== "ul") { closeList(); out.push("<ul>"); list = "ul"; }
          out.push("<li>" + inline(m[1]) + "</li>");
        } else if ((m = line.match(/^\s*\d+[.)]\s+(.*)$/))) {
          if (list !== "ol") { closeList(); out.push("<ol>"); list = "ol"; }
          out.push("<li>" + inline(m[1]) + "</li>");
        } else if (line.trim() === "") {
          closeList();
        } else {
          closeList();
          out.push("<p>" + inline(line) + "</p>");
        }
      }
      closeList();
    });
    return out.join("");
  }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.innerHTML = '<div class="role"></div><details class="reasoning" hidden><summary>Reasoning</summary><div class="rtext"></div></details><div class="content"></div><div class="stats"></div>';
    div.querySelector(".role").textContent = role;
    if (text) div.querySelector(".content").innerHTML = markdown(text);
    log.appendChild(div);
    log.scrollTop = log.scrollHeight;
    return div;
  }

  function setBusy(busy) {
    sendBtn.disabled = busy;
    stopBtn.disabled = !busy;
  }

  async function send(text) {
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const div = addMessage("assistant", "");
    const contentEl = div.querySelector(".content"), statsEl = div.querySelector(".stats");
    const rBox = div.querySelector(".reasoning"), rText = div.querySelector(".rtext");
    const body = { messages: history.slice(), stream: true, stream_options: { include_usage: true } };
    if ($("model").value) body.model = $("model").value;
    if ($("temperature").value !== "") body.temperature = Number($("temperature").value);
    if ($("maxtokens").value !== "") body.max_tokens = Number($("maxtokens").value);
    const headers = { "content-type": "application/json" };
    if ($("apikey").value) headers.authorization = "Bearer " + $("apikey").value;
    controller = new AbortController();
    setBusy(true);
    let answer = "", reasoning = "", chunks = 0, first = null, usage = null, stopped = false;
    const t0 = performance.now();
    const showStats = (note) => {
      const n = usage ? usage.completion_tokens : chunks;
      const dt = first === null ? 0 : (performance.now() - first) / 1000;
      const rate = dt > 0 && n > 1 ? ((n - 1) / dt).toFixed(1) + " tok/s" : "";
      const ttft = first === null ? "" : "first token " + ((first - t0) / 1000).toFixed(2) + " s";
      statsEl.textContent = [n + " tokens", rate, ttft, note].filter(Boolean).join(" · ");
    };
    try {
      const resp = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body), signal: controller.signal });
      if (!resp.ok) {
        const err = await resp.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || resp.status + " " + resp.statusText);
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let at;
        while ((at = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, at);
          buf = buf.slice(at + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message || "error");
            if (obj.usage) usage = obj.usage;
            const ch = obj.choices && obj.choices[0];
            if (!ch || !ch.delta) continue;
            const r = ch.delta.reasoning_content || "";
            const c = ch.delta.content || "";
            if (r || c) { chunks++; if (first === null) first = performance.now(); }
            if (r) { reasoning += r; rBox.hidden = false; rText.textContent = reasoning; }
            if (c) { answer += c; contentEl.innerHTML = markdown(answer); }
            showStats();
            log.scrollTop = log.scrollHeight;
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") {
        stopped = true;
      } else {
        div.classList.add("error");
        contentEl.textContent = (answer ? answer + "\n\n" : "") + "Error: " + e.message;
      }
    } finally {
      controller = null;
      setBusy(false);
      showStats(stopped ? "stopped" : "");
      div.dataset.done = stopped ? "stopped" : "1";
      if (answer) history.push({ role: "assistant", content: answer });
    }
  }

  $("form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || controller) return;
    input.value = "";
    send(text);
  });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
  });
  stopBtn.addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => { if (controller) controller.abort(); history.length = 0; log.innerHTML = ""; });
})();
