// outbox dashboard: live refresh, in plain JavaScript (no build step).
// An element with an id and data-refresh="SECONDS" is replaced every SECONDS by the
// same element of the page fetched again (same URL, same credentials), while the tab
// is visible. Nothing else runs on the page.
"use strict";
document.querySelectorAll("[data-refresh][id]").forEach((el) => {
  const every = Math.max(1, Number(el.dataset.refresh)) * 1000;
  setInterval(async () => {
    if (document.hidden) return;
    try {
      const response = await fetch(location.href, { credentials: "same-origin" });
      if (!response.ok) return;
      const fresh = new DOMParser()
        .parseFromString(await response.text(), "text/html")
        .getElementById(el.id);
      if (fresh) el.replaceChildren(...fresh.childNodes);
    } catch (_) {
      // Offline for a moment: the next tick tries again.
    }
  }, every);
});
// "Select all" for the checkbox column of a listing.
document.querySelectorAll("input[data-select-all]").forEach((box) => {
  box.addEventListener("change", () => {
    document
      .querySelectorAll("input[type=checkbox][name=id]")
      .forEach((b) => { b.checked = box.checked; });
  });
});
