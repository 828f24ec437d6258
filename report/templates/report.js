// Copy buttons on commands and diffs. Nothing else needs script: charts are inline SVG.
(function () {
  function copyText(text, button) {
    function done() { button.textContent = "copied"; setTimeout(function () { button.textContent = "copy"; }, 1200); }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { fallback(text); done(); });
    } else { fallback(text); done(); }
  }
  function fallback(text) {
    var area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (e) { /* the text stays selectable */ }
    document.body.removeChild(area);
  }
  document.querySelectorAll(".copyable").forEach(function (box) {
    var pre = box.querySelector("pre");
    var button = document.createElement("button");
    button.className = "copy";
    button.type = "button";
    button.textContent = "copy";
    button.addEventListener("click", function () { copyText(pre.dataset.copy || pre.innerText, button); });
    box.appendChild(button);
  });
  // the step chart's x axis: wall time (start-up and gaps visible) or one bar per step
  document.querySelectorAll(".view-switch button").forEach(function (button) {
    button.addEventListener("click", function () {
      var section = button.closest("section");
      section.querySelectorAll(".view-switch button").forEach(function (b) {
        b.classList.toggle("on", b === button);
      });
      section.querySelectorAll(".step-views > div").forEach(function (view) {
        view.hidden = view.dataset.view !== button.dataset.view;
      });
    });
  });
  document.documentElement.dataset.ready = "1";
})();
