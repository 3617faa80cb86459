// The playground's tabs: Generate, the race, and the KV-block map. The address's #fragment names the open
// tab, so each can be linked to; the map watches the server only while its tab is open.
import { $ } from "./api.js";
import { Race } from "./race.js";
import { KVMap } from "./kvmap.js";
import { GuidedDemo } from "./demo.js";

const TABS = ["generate", "race", "kv"];
const map = new KVMap();
new Race();
new GuidedDemo(map);

function showTab() {
  const name = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "generate";
  for (const tab of TABS) {
    $(`tab-${tab}`).hidden = tab !== name;
    document.querySelector(`nav a[data-tab="${tab}"]`).classList.toggle("active", tab === name);
  }
  if (name === "kv") map.start();
  else map.stop();
}

window.addEventListener("hashchange", showTab);
$("api-key").addEventListener("change", () => { if (location.hash === "#kv") { map.stop(); map.start(); } });
showTab();
