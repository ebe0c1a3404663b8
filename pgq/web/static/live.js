// Live pages: every data-refresh ms, fetch this page's live part (?live=1) and swap it in.
// The server escapes everything it renders; a failed fetch says so and tries again, and
// so does one that has not ended after 5 refreshes (at least 10 s).
// An update keeps what the reader did: an unchanged part is not replaced, no update
// lands while text in it is selected, and scrolled boxes keep their place.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var every = Number(live.getAttribute("data-refresh")) || 2000;
  var status = document.getElementById("live-status");
  var last = null;
  function say(text, bad) {
    if (!status) return;
    status.textContent = text;
    status.className = "live-status " + (bad ? "bad" : "ok");
  }
  function selecting() {
    var s = window.getSelection();
    return s && !s.isCollapsed && live.contains(s.anchorNode);
  }
  function swap(html) {
    if (html === last) return;
    var scrolled = {};
    live.querySelectorAll("[id]").forEach(function (e) {
      if (e.scrollTop || e.scrollLeft) scrolled[e.id] = [e.scrollTop, e.scrollLeft];
    });
    live.innerHTML = html;
    last = html;
    Object.keys(scrolled).forEach(function (id) {
      var e = document.getElementById(id);
      if (e) { e.scrollTop = scrolled[id][0]; e.scrollLeft = scrolled[id][1]; }
    });
  }
  function tick() {
    if (document.hidden) { setTimeout(tick, every); return; }
    if (selecting()) { say("paused while text is selected", false); setTimeout(tick, every); return; }
    var url = new URL(window.location.href);
    url.searchParams.set("live", "1");
    var abort = new AbortController();  // an update that never ends is a lost connection
    var late = setTimeout(function () { abort.abort(); }, Math.max(10000, 5 * every));
    fetch(url.toString(), { credentials: "same-origin", cache: "no-store", signal: abort.signal })
      .then(function (r) {
        if (!r.ok) { say("update failed: HTTP " + r.status, true); return; }
        return r.text().then(function (html) {
          if (!selecting()) swap(html);
          say("live · " + new Date().toLocaleTimeString(), false);
        });
      })
      .catch(function () { say("connection lost, retrying", true); })
      .then(function () { clearTimeout(late); setTimeout(tick, every); });
  }
  say("live", false);
  setTimeout(tick, every);
})();
