// Live pages: every data-refresh ms, fetch this page's live part (?live=1) and swap it in.
// The server escapes everything it renders; a failed fetch says so and tries again.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var every = Number(live.getAttribute("data-refresh")) || 2000;
  var status = document.getElementById("live-status");
  function say(text, bad) {
    if (!status) return;
    status.textContent = text;
    status.className = "live-status " + (bad ? "bad" : "ok");
  }
  function tick() {
    if (document.hidden) { setTimeout(tick, every); return; }
    var url = new URL(window.location.href);
    url.searchParams.set("live", "1");
    fetch(url.toString(), { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (!r.ok) { say("update failed: HTTP " + r.status, true); return; }
        return r.text().then(function (html) {
          live.innerHTML = html;
          say("live · " + new Date().toLocaleTimeString(), false);
        });
      })
      .catch(function () { say("connection lost, retrying", true); })
      .then(function () { setTimeout(tick, every); });
  }
  say("live", false);
  setTimeout(tick, every);
})();
