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
  document.documentElement.dataset.ready = "1";
})();
