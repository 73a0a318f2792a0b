// Live parts of a dashboard page: every element with data-live="URL" is fetched again
// every data-every seconds and replaced by the server's rendering (already escaped there;
// the Content-Security-Policy runs no script that came with it). No library, no build step.
"use strict";
(function () {
  function watch(element) {
    const every = 1000 * (Number(element.dataset.every) || 5);
    async function refresh() {
      try {
        const answer = await fetch(element.dataset.live, {credentials: "same-origin"});
        if (!answer.ok) throw new Error("HTTP " + answer.status);
        // A <details> the reader opened (a long error's whole text) stays open.
        const open = [...element.querySelectorAll("details")].map((d) => d.open);
        element.innerHTML = await answer.text();
        element.querySelectorAll("details").forEach((d, i) => { if (open[i]) d.open = true; });
        element.dataset.refreshed = String(Date.now());
        element.dispatchEvent(new CustomEvent("live:updated", {bubbles: true}));
        document.body.classList.remove("offline");
      } catch (error) {
        document.body.classList.add("offline");  // the dashboard itself is unreachable
      }
      setTimeout(refresh, every);
    }
    setTimeout(refresh, every);
  }
  document.querySelectorAll("[data-live]").forEach(watch);
})();
