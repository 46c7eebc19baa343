// The chat page: send a message over the chat websocket, show the answer's tokens as they arrive,
// stop it on demand. A socket that closes mid-answer (a network blip, a web worker's restart) is
// opened again and asks for the rest of the answer from its last piece; a page reloaded mid-answer
// asks for all of it. The protocol is described in platform/controlplane/chat/protocol.py.
(function () {
  "use strict";
  const list = document.getElementById("messages");
  const form = document.getElementById("composer");
  const prompt = document.getElementById("prompt");
  const sendButton = document.getElementById("send");
  const stopButton = document.getElementById("stop");
  const status = document.getElementById("status");
  let conversation = list.dataset.conversation ? Number(list.dataset.conversation) : null;
  let answer = null; // the <li> being written: data-id is its id, data-after the pieces of it shown
  let sent = null; // the message on its way: { text, bubble } until the server takes or refuses it
  let socket = null;

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}/ws/chat/`);
    socket.addEventListener("message", (event) => handle(JSON.parse(event.data)));
    socket.addEventListener("close", (event) => {
      // 4429: this user has as many chat pages open as one may; this one tries again now and then.
      const tooMany = event.code === 4429;
      status.textContent = tooMany ? `${event.reason}; trying again…` : "disconnected; reconnecting…";
      setBusy(busy);
      setTimeout(connect, tooMany ? 5000 : 1000);
    });
    socket.addEventListener("open", () => {
      status.textContent = "";
      if (answer && answer.dataset.id) { // the answer goes on without the page: ask for the rest
        socket.send(JSON.stringify({ type: "resume", answer: Number(answer.dataset.id), after: Number(answer.dataset.after || 0) }));
      } else if (answer) { // closed before the server said it took the message: it may not have
        giveBack("the connection dropped before the server took your message; reload to see whether it did");
      }
      setBusy(busy);
    });
    setBusy(busy); // Send waits for the socket: a message sent before it opens would go nowhere
  }

  function bubble(role, text, extra) {
    const item = document.createElement("li");
    item.className = `message ${role} ${extra || ""}`;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    item.appendChild(content);
    if (role === "assistant") {
      const figures = document.createElement("div");
      figures.className = "figures";
      item.appendChild(figures);
    }
    list.appendChild(item);
    item.scrollIntoView({ block: "end" });
    return item;
  }

  let busy = false;
  function setBusy(answering) {
    busy = answering;
    sendButton.disabled = busy || !socket || socket.readyState !== WebSocket.OPEN;
    stopButton.disabled = !busy;
  }

  function figures(metrics, state) {
    const parts = [];
    if (metrics.ttft_ms != null) parts.push(`TTFT ${Math.round(metrics.ttft_ms)} ms`);
    if (metrics.decode_tok_s != null) parts.push(`${metrics.decode_tok_s.toFixed(1)} tok/s`);
    if (metrics.recall != null) parts.push(`recall ${Math.round(metrics.recall * 100)}%`);
    if (metrics.taken_over_at != null) parts.push("carried across a server restart");
    if (state === "stopped") parts.push("stopped");
    return parts.join(" · ");
  }

  function handle(message) {
    if (message.type === "conversation") {
      sent = null; // taken: the server has stored it
      if (answer) answer.dataset.id = message.answer;
      if (conversation !== message.id) {
        conversation = message.id;
        history.replaceState(null, "", `/chat/${conversation}/`);
      }
    } else if (message.type === "token" && answer) {
      answer.querySelector(".content").textContent += message.text;
      answer.dataset.tokens = String(Number(answer.dataset.tokens || 0) + 1);
      answer.dataset.after = String(message.index + 1);
      answer.scrollIntoView({ block: "end" });
    } else if (message.type === "done" && answer) {
      answer.querySelector(".content").textContent = message.content;
      answer.querySelector(".figures").textContent = figures(message.metrics, message.status);
      answer.classList.remove("streaming");
      answer.classList.add(message.status);
      answer.dataset.id = message.message_id;
      answer = null;
      setBusy(false);
    } else if (message.type === "error" && message.refused && sent) {
      giveBack(message.detail); // turned away before anything was stored
    } else if (message.type === "error" && message.answer != null && answer) {
      // The answer it waited for cannot be followed: it stops waiting.
      answer.classList.remove("streaming");
      answer.classList.add("failed");
      answer.querySelector(".figures").textContent = message.detail;
      answer = null;
      setBusy(false);
    } else if (message.type === "error") {
      status.textContent = message.detail;
      status.className = "error";
      if (answer) answer.querySelector(".figures").textContent = message.detail;
    }
  }

  // The message goes back where it was written, its bubbles removed, and the reason shown.
  function giveBack(detail) {
    if (sent) {
      sent.bubble.remove();
      if (!prompt.value) prompt.value = sent.text;
    }
    if (answer) answer.remove();
    answer = null;
    sent = null;
    setBusy(false);
    status.textContent = detail;
    status.className = "error";
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value;
    if (!text.trim() || !socket || socket.readyState !== WebSocket.OPEN) return;
    status.textContent = "";
    status.className = "";
    sent = { text: text, bubble: bubble("user", text) };
    answer = bubble("assistant", "", "streaming");
    setBusy(true);
    socket.send(JSON.stringify({ type: "send", conversation: conversation, content: text }));
    prompt.value = "";
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  stopButton.addEventListener("click", () => {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify({ type: "stop" }));
  });
  // Reloaded while an answer is written: it is shown again from its start as it goes on.
  const unfinished = list.querySelector("li.message.assistant.streaming[data-id]");
  if (unfinished) {
    answer = unfinished;
    answer.querySelector(".content").textContent = "";
    busy = true;
  }
  connect();
})();
